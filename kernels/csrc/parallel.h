// A tiny fork-join helper over a persistent pool of workers for the CPU kernels.
//
// A one-token decode step calls a kernel every ~20-100 us, and a worker asleep on a condition
// variable wakes 50-100 us late on the 2-core dev VM: it would miss most calls. So a worker that
// finishes a job spins (pausing, yielding to other threads) for spin_us microseconds (default 50;
// KernelSettings.spin_us, METRALE_SPIN_US, set by kernels/ext.py) waiting for the next one before it
// sleeps. 0 never spins. A longer
// spin helps a lone in-process engine slightly but starves the server's event loop and co-located
// clients on a small machine: over HTTP at one stream on 2 cores, 200 us measured ~15% slower than 0-50.
#pragma once

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace metrale {

namespace detail {

inline std::atomic<int>& requested_threads() {  // 0: one per CPU this process may run on
  static std::atomic<int> n{0};
  return n;
}

inline std::atomic<bool>& threads_fixed() {
  static std::atomic<bool> fixed{false};
  return fixed;
}

inline std::atomic<int64_t>& spin_microseconds() {
  static std::atomic<int64_t> us{50};
  return us;
}

inline int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace detail

// Threads the kernels use: what set_num_threads asked for before the first kernel ran
// (KernelSettings.attention_threads, METRALE_ATTENTION_THREADS), else the CPUs this process may run on.
inline int num_threads() {
  static const int n = [] {
    detail::threads_fixed().store(true);
    const int requested = detail::requested_threads().load();
    return requested >= 1 ? requested : detail::available_cpus();
  }();
  return n;
}

// Ask for `n` kernel threads (0: one per available CPU). Only before the first kernel runs: afterwards
// the count is fixed and this returns false unless it already is `n`.
inline bool set_num_threads(int n) {
  if (!detail::threads_fixed().load()) {
    detail::requested_threads().store(std::max(0, n));
    return true;
  }
  return num_threads() == (n >= 1 ? n : detail::available_cpus());
}

// How long an idle worker spins before it sleeps (microseconds, >= 0); takes effect at its next wait.
inline void set_spin_us(int64_t us) { detail::spin_microseconds().store(std::max<int64_t>(0, us)); }

namespace detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// One parallel_for call: tasks are taken from `next` by the caller and any worker that joins.
struct Job {
  std::atomic<int> next{0}, done{0}, participants{0};
  int n_tasks = 0;
  int max_participants = 1;
  std::function<void(int, int)> f;  // (task, participant)

  // Runs tasks until none is left; f is only called while the caller still waits (done < n_tasks).
  void run() {
    const int me = participants.fetch_add(1);
    if (me >= max_participants) return;  // more helpers than the caller asked for
    for (int i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      f(i, me);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) std::thread([this] { loop(); }).detach();
  }

  // Offers `job` to the workers; returns at once (the caller runs tasks too).
  void publish(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
  }

 private:
  void loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      const std::chrono::microseconds spin_(spin_microseconds().load(std::memory_order_relaxed));
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() - start > spin_) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
          break;
        }
        if ((spins & 15) == 15) std::this_thread::yield();  // a busy machine: let others run
        cpu_relax();
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job) job->run();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::shared_ptr<Job> job_;
};

inline Pool& worker_pool() {
  // Leaked on purpose, with detached workers: joining threads from a static destructor at interpreter
  // exit is fragile.
  static Pool* pool = new Pool(std::max(0, num_threads() - 1));
  return *pool;
}

}  // namespace detail

// Runs f(task, participant) for task in [0, n_tasks) on the caller plus up to `width - 1` pool
// workers, participant in [0, width) naming per-thread scratch. f must not throw. The caller
// returns once every task is done, without waiting for a worker that woke too late to take one.
template <typename F>
void parallel_for(int n_tasks, int width, const F& f) {
  if (width <= 1 || n_tasks <= 1) {
    for (int i = 0; i < n_tasks; ++i) f(i, 0);
    return;
  }
  auto job = std::make_shared<detail::Job>();
  job->n_tasks = n_tasks;
  job->max_participants = width;
  job->f = [&f](int task, int me) { f(task, me); };  // f outlives every call: the caller waits below
  detail::worker_pool().publish(job);
  job->run();
  while (job->done.load(std::memory_order_acquire) < n_tasks) detail::cpu_relax();
}

}  // namespace metrale
