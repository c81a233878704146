/* OpenMP where the compiler has it; otherwise (Apple's clang, which accel/kernels/_build.py then runs without
 * -fopenmp) one-thread stand-ins for the calls the kernels make, and the pragmas are ignored. */
#ifndef ACCEL_OMP_COMPAT_H
#define ACCEL_OMP_COMPAT_H
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif
#endif
