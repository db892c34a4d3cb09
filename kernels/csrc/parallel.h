// A tiny fork-join helper over a persistent pool (mlx/threadpool.h) for the CPU kernels.
#pragma once

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <thread>

#include "mlx/threadpool.h"

namespace metrale {

// Threads the kernels use: METRALE_ATTENTION_THREADS, else the CPUs this process may run on.
inline int num_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("METRALE_ATTENTION_THREADS")) {
      int v = std::atoi(env);
      if (v >= 1) return v;
    }
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

inline ThreadPool& worker_pool() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit is fragile.
  static ThreadPool* pool = new ThreadPool(std::max(0, num_threads() - 1));
  return *pool;
}

// Runs f(task, participant) for task in [0, n_tasks) on the caller plus up to `width - 1` pool
// workers, participant in [0, width) naming per-thread scratch. f must not throw. The caller
// returns once every task is done, without waiting for a worker that woke too late to take one
// (on a busy machine a worker may be scheduled long after the work is over).
template <typename F>
void parallel_for(int n_tasks, int width, const F& f) {
  if (width <= 1 || n_tasks <= 1) {
    for (int i = 0; i < n_tasks; ++i) f(i, 0);
    return;
  }
  struct Job {
    std::atomic<int> next{0}, done{0}, participants{0};
    int n_tasks;
    const F* f;
  };
  auto job = std::make_shared<Job>();
  job->n_tasks = n_tasks;
  job->f = &f;
  auto run = [job] {
    const int me = job->participants.fetch_add(1);
    for (int i = job->next.fetch_add(1); i < job->n_tasks; i = job->next.fetch_add(1)) {
      (*job->f)(i, me);  // only reached while the caller is still waiting: f is alive
      job->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int k = 1; k < width; ++k) worker_pool().enqueue(run);  // futures dropped: nothing waits on them
  run();
  while (job->done.load(std::memory_order_acquire) < n_tasks) std::this_thread::yield();
}

}  // namespace metrale
