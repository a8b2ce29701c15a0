// The large buffers the kernels stream every step (packed weights, KV pools) on transparent huge pages.
//
// Why: a batch-1 decode step reads every weight once (~750 MB for Qwen3-0.6B A8W8 with its bf16 head); on 4 KiB
// pages each 4 KiB of that stream is a TLB miss, and in a virtual machine a miss walks two page tables. Measured on
// the 2-core AVX2 VM (AMD EPYC, 2026-12-02, 2 threads, a standalone loop over 56 distinct 4 MB int8 matrices, the
// two allocations alternated in one minute): a plain read 15.7-17.3 GB/s on 4 KiB pages, 19.3-26.7 GB/s on 2 MiB
// pages; the int8 GEMV 14.0-15.4 against 17.7-22.8 GB/s. Linux's common THP mode (`madvise`) gives anonymous
// memory huge pages only where madvise(MADV_HUGEPAGE) asks for them; PyTorch's CPU allocator asks only with
// THP_MEM_ALLOC_ENABLE=1, which it reads once, at the process's first allocation (before any library can set it),
// so the kernels allocate their streamed buffers themselves.
//
// How: anonymous mappings aligned to 2 MiB and madvised, "arenas" of 64 MiB from which tensors are carved on 4 KiB
// boundaries (a tensor of 32 MiB or more gets a mapping of its own); an arena is unmapped when the last tensor carved
// from it is freed (each tensor's deleter holds a reference). Pages are faulted in lazily, so an arena's untouched
// tail costs no memory (at most the partly used last 2 MiB page of each arena is resident beyond the tensors).
// Smaller tensors, non-Linux hosts and a failed mapping take at::empty: huge pages are a speed-up, never a
// requirement, and the bits are the same either way.
#include "common.h"
#include "ops.h"

#include <memory>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace qk {
namespace {

constexpr size_t kHuge = size_t{2} << 20;
constexpr size_t kArenaBytes = size_t{64} << 20;
constexpr size_t kOwnMapping = size_t{32} << 20;   // a tensor this large gets a mapping of its own
constexpr size_t kMinBytes = size_t{256} << 10;    // smaller tensors: at::empty
constexpr size_t kAlign = 4096;

#if defined(__linux__)
struct Mapping {
  char* base = nullptr;   // 2 MiB aligned
  size_t size = 0;
  char* raw = nullptr;
  size_t raw_size = 0;
  size_t used = 0;
  ~Mapping() {
    if (raw) munmap(raw, raw_size);
  }
};

std::shared_ptr<Mapping> map_huge(size_t bytes) {
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  const size_t raw_size = size + kHuge;   // room to align the start
  void* raw = mmap(nullptr, raw_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto m = std::make_shared<Mapping>();
  m->raw = static_cast<char*>(raw);
  m->raw_size = raw_size;
  m->base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(uintptr_t{kHuge} - 1));
  m->size = size;
#if defined(MADV_HUGEPAGE)
  madvise(m->base, size, MADV_HUGEPAGE);   // best effort: without THP the pages stay 4 KiB, same bits
#endif
  return m;
}

std::mutex g_mu;
std::shared_ptr<Mapping> g_arena;   // the arena tensors are carved from now
#endif

at::Tensor stream_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  const auto opts = at::TensorOptions().dtype(dtype).device(at::kCPU);
#if defined(__linux__)
  if (bytes >= kMinBytes) {
    std::shared_ptr<Mapping> m;
    char* ptr = nullptr;
    if (bytes >= kOwnMapping) {
      m = map_huge(bytes);
      if (m) ptr = m->base;
    } else {
      std::lock_guard<std::mutex> lock(g_mu);
      const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
      if (!g_arena || g_arena->used + need > g_arena->size) g_arena = map_huge(kArenaBytes);
      if (g_arena) {
        m = g_arena;
        ptr = m->base + m->used;
        m->used += need;
      }
    }
    if (ptr) return at::from_blob(ptr, sizes, [m](void*) mutable { m.reset(); }, opts);
  }
#endif
  return at::empty(sizes, opts);
}

}  // namespace

at::Tensor stream_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor t = stream_empty(sizes, dtype);
  t.zero_();   // the first touch: faults the pages in (huge where the mapping has them)
  return t;
}

}  // namespace qk
