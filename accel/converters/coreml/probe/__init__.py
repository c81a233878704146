"""The ANE probe: a macOS harness shipped inside each package, and the Linux side that reads its captures."""
