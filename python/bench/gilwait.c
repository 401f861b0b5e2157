// A diagnostic for python/bench/vs_torch.py (not part of pinstream): the time each thread
// waits in pthread condition variables, by condition variable, so that the training thread's
// waits for CPython's GIL show apart from its other waits (the CUDA driver's, in a sync).
// Build and preload: gcc -O2 -shared -fPIC -o gilwait.so gilwait.c -ldl
//                    LD_PRELOAD=$PWD/gilwait.so python3 vs_torch.py ...
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

#define SLOTS 16
static int (*real_tw)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
static int (*real_w)(pthread_cond_t *, pthread_mutex_t *);
static int (*real_cw)(pthread_cond_t *, pthread_mutex_t *, clockid_t, const struct timespec *);
static __thread const void *keys[SLOTS];
static __thread unsigned long long ns_[SLOTS], n_[SLOTS];

static unsigned long long now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + t.tv_nsec;
}

static void add(const void *c, unsigned long long d) {
  int i;
  for (i = 0; i < SLOTS - 1 && keys[i] && keys[i] != c; i++) {
  }
  if (!keys[i]) keys[i] = c;  // the last slot takes every condition beyond the others
  ns_[i] += d;
  n_[i]++;
}

int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *a) {
  if (!real_tw) real_tw = dlvsym(RTLD_NEXT, "pthread_cond_timedwait", "GLIBC_2.3.2");
  if (!real_tw) real_tw = dlsym(RTLD_NEXT, "pthread_cond_timedwait");
  unsigned long long t = now();
  int r = real_tw(c, m, a);
  add(c, now() - t);
  return r;
}

int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) {
  if (!real_w) real_w = dlvsym(RTLD_NEXT, "pthread_cond_wait", "GLIBC_2.3.2");
  if (!real_w) real_w = dlsym(RTLD_NEXT, "pthread_cond_wait");
  unsigned long long t = now();
  int r = real_w(c, m);
  add(c, now() - t);
  return r;
}

int pthread_cond_clockwait(pthread_cond_t *c, pthread_mutex_t *m, clockid_t k,
                           const struct timespec *a) {
  if (!real_cw) real_cw = dlsym(RTLD_NEXT, "pthread_cond_clockwait");
  unsigned long long t = now();
  int r = real_cw(c, m, k, a);
  add(c, now() - t);
  return r;
}

// The calling thread's waits: up to `max` entries of (condition, ns, count); returns how many.
int gilwait_table(unsigned long long *cond, unsigned long long *ns, unsigned long long *n,
                  int max) {
  int k = 0;
  for (int i = 0; i < SLOTS && i < max && keys[i]; i++, k++) {
    cond[i] = (unsigned long long)keys[i];
    ns[i] = ns_[i];
    n[i] = n_[i];
  }
  return k;
}
