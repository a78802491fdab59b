// ortwrap's CPU region: PyTorch's, ONNX Runtime's and ortwrap's kernels' large CPU blocks from one
// best-fit region while ONNX Runtime runs.
//
// Why (docs/performance.md, "Both libraries' large blocks in one region"): inside ORT's runs, ORT's
// blocks, the kernels' and PyTorch's (the bridge's GEMM outputs and casts, the gradients) alternate
// at a fine grain, each surrounded by small chunks that glibc's per-thread cache keeps "in use"; the
// freed regions between them do not merge, and the backward extends the heap (bf16 autocast, GPT-2
// small, batch 4: 1.04-1.10x eager's peak RSS). Served from one best-fit region instead, the freed
// blocks merge with each other whatever glibc does around them.
//
// This is the one C++ file of ortwrap, and it is part of the compat boundary (ortwrap/_compat): it
// uses torch's C++ API, c10::Allocator, c10::GetCPUAllocator and c10::SetCPUAllocator (declared in
// c10/core/Allocator.h and c10/core/CPUAllocator.h), run on torch 2.13.0 and 2.14.1, compiled and
// linked against 2.15.0 (docs/compat.md). It is compiled on first use against the running torch's
// headers (runtime/cpu_region.py); the cache key includes torch's version, so each release gets its
// own build.
//
// Contract:
//   - ortwrap_region_enter()/ortwrap_region_exit() bracket each ORT run (nested and concurrent
//     brackets count: the allocator is swapped in at the first enter and restored at the last exit).
//   - PyTorch's requests of at least kMinBytes come from the region; smaller ones, and any the region
//     cannot serve (address space or commit refused), go to the allocator that was installed. ORT's
//     and the kernels' likewise, through their GOT slots (ortwrap_region_hook, below).
//   - A block keeps its deleter whoever frees it and whenever: the region outlives every tensor (it
//     is never unmapped), and raw_deleter() and the hooked free() route a pointer by the range it
//     lies in.
//   - The region's pages stay resident once touched (the next step reuses them, as glibc's heap
//     does with its free chunks); ortwrap_region_release() gives its free pages back to the OS.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace {

constexpr size_t kGranule = size_t(64) << 10;  // block sizes and offsets: 64 KiB multiples
constexpr size_t kCommitStep = size_t(64) << 20;  // address space made writable 64 MiB at a time

constexpr size_t kMinBytes = size_t(1) << 20;  // smaller requests go where they went before
char* base = nullptr;
size_t reserved = 0;   // bytes of address space reserved (PROT_NONE until committed)
size_t committed = 0;  // bytes made writable, from base
size_t top = 0;        // end of the highest block ever handed out
bool broken = false;   // reserving the address space failed: serve nothing
std::mutex mu;
std::map<size_t, size_t> free_at;                // offset -> size of each free range
std::set<std::pair<size_t, size_t>> free_sized;  // (size, offset) of the same ranges: best fit
std::unordered_map<size_t, size_t> used;         // offset -> size of each live block
uint64_t n_region = 0, n_hooked = 0, n_refused = 0, in_use = 0, peak_in_use = 0;  // blocks to PyTorch, to the hooked libraries

void add_free(size_t off, size_t size) {
  free_at.emplace(off, size);
  free_sized.emplace(size, off);
}

void remove_free(std::map<size_t, size_t>::iterator it) {
  free_sized.erase({it->second, it->first});
  free_at.erase(it);
}

bool reserve_locked() {
  if (base || broken) return !broken;
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  size_t want = (pages > 0 && page > 0) ? size_t(pages) * size_t(page) : (size_t(64) << 30);
  want = (want + kCommitStep - 1) / kCommitStep * kCommitStep;
  // One granule more, so that base (and every block) is granule-aligned: posix_memalign's callers
  // may ask for up to kGranule.
  void* p = mmap(nullptr, want + kGranule, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    broken = true;
    return false;
  }
  uintptr_t aligned = (reinterpret_cast<uintptr_t>(p) + kGranule - 1) & ~uintptr_t(kGranule - 1);
  base = reinterpret_cast<char*>(aligned);
  reserved = want;
  return true;
}

// Offset of a new block of n bytes (n a granule multiple), or SIZE_MAX.
size_t take_locked(size_t n) {
  auto best = free_sized.lower_bound({n, 0});
  if (best != free_sized.end()) {
    size_t size = best->first, off = best->second;
    free_sized.erase(best);
    free_at.erase(off);
    if (size > n) add_free(off + n, size - n);
    return off;
  }
  // Nothing fits: extend the top, starting inside a free range that ends there.
  size_t off = top;
  if (!free_at.empty()) {
    auto last = std::prev(free_at.end());
    if (last->first + last->second == top) off = last->first;
  }
  size_t end = off + n;
  if (end > reserved) return SIZE_MAX;
  if (end > committed) {
    size_t grow = (end - committed + kCommitStep - 1) / kCommitStep * kCommitStep;
    if (committed + grow > reserved) grow = reserved - committed;
    if (mprotect(base + committed, grow, PROT_READ | PROT_WRITE) != 0) return SIZE_MAX;
    committed += grow;
  }
  if (off != top) remove_free(std::prev(free_at.end()));
  top = end;
  return off;
}

void give_back_locked(size_t off) {
  auto u = used.find(off);
  if (u == used.end()) return;  // not a block's start (a double free): leave the region as it is
  size_t n = u->second;
  used.erase(u);
  in_use -= n;
  auto next = free_at.lower_bound(off);
  if (next != free_at.end() && off + n == next->first) {
    n += next->second;
    remove_free(next);
  }
  auto after = free_at.lower_bound(off);
  if (after != free_at.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == off) {
      off = prev->first;
      n += prev->second;
      remove_free(prev);
    }
  }
  add_free(off, n);
}

bool in_region(const void* p) {
  const char* c = static_cast<const char*>(p);
  return base != nullptr && c >= base && c < base + reserved;
}

void free_block(void* p) {
  std::lock_guard<std::mutex> guard(mu);
  give_back_locked(static_cast<size_t>(static_cast<char*>(p) - base));
}

// A block of at least nbytes from the region, counted in *served, or nullptr (counted as refused):
// the one path of PyTorch's and the hooked libraries' requests.
void* take_block(size_t nbytes, uint64_t* served) {
  size_t n = (nbytes + kGranule - 1) / kGranule * kGranule;
  std::lock_guard<std::mutex> guard(mu);
  size_t off = reserve_locked() ? take_locked(n) : SIZE_MAX;
  if (off == SIZE_MAX) {
    ++n_refused;
    return nullptr;
  }
  used.emplace(off, n);
  in_use += n;
  if (in_use > peak_in_use) peak_in_use = in_use;
  ++*served;
  return base + off;
}

c10::DeleterFnPtr fallback_raw_deleter = nullptr;

void free_any(void* p) {
  if (in_region(p))
    free_block(p);
  else if (fallback_raw_deleter)
    fallback_raw_deleter(p);
}

struct RegionAllocator final : c10::Allocator {
  c10::Allocator* fallback = nullptr;

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes >= kMinBytes) {
      if (void* p = take_block(nbytes, &n_region)) return {p, p, &free_block, c10::Device(c10::DeviceType::CPU)};
    }
    return fallback->allocate(nbytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

RegionAllocator region;
c10::Allocator* saved = nullptr;
int depth = 0;
std::atomic<int> active{0};  // depth, for the hooks' lock-free check
std::mutex swap_mu;

// ---- ONNX Runtime's and ortwrap's kernels' blocks in the same region ------------------------------
// ORT's CPU allocator (no arena: ortwrap registers the plain one) takes each tensor buffer with
// posix_memalign and gives it back with free, called through the GOT of ORT's Python module; the
// outputs of ortwrap's CPU kernels (kernels/_cpu.c) come from aligned_alloc. The 1.19.2 training
// wheel's module exports no C API to register another allocator, so ortwrap points those GOT slots
// of those two libraries (ortwrap_region_hook) at the functions below: while a run is bracketed,
// their requests of at least kMinBytes come from the region too (the freed blocks then merge with
// PyTorch's); everything else, and every pointer outside the region, goes to the C library as
// before. Nothing else in the process is affected.
int (*real_posix_memalign)(void**, size_t, size_t) = &::posix_memalign;
void* (*real_aligned_alloc)(size_t, size_t) = &::aligned_alloc;
void (*real_free)(void*) = &::free;

int hooked_posix_memalign(void** out, size_t alignment, size_t nbytes) {
  if (active.load(std::memory_order_relaxed) > 0 && nbytes >= kMinBytes && alignment <= kGranule) {
    if (void* p = take_block(nbytes, &n_hooked)) {
      *out = p;
      return 0;
    }
  }
  return real_posix_memalign(out, alignment, nbytes);
}

void* hooked_aligned_alloc(size_t alignment, size_t nbytes) {
  void* p = nullptr;
  // (aligned_alloc's contract is posix_memalign's with the error in errno instead of the result)
  int err = hooked_posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment, nbytes);
  if (err != 0) {
    errno = err;
    return nullptr;
  }
  return p;
}

void hooked_free(void* p) {
  if (in_region(p))
    free_block(p);
  else
    real_free(p);
}

#if defined(__x86_64__)
constexpr unsigned kJumpSlot = R_X86_64_JUMP_SLOT, kGlobDat = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
constexpr unsigned kJumpSlot = R_AARCH64_JUMP_SLOT, kGlobDat = R_AARCH64_GLOB_DAT;
#else
constexpr unsigned kJumpSlot = ~0u, kGlobDat = ~0u;  // no hook: PyTorch's blocks only
#endif

struct HookRequest {
  const char* name_part;
  int patched;
  int found;
};

// Point the GOT slots of posix_memalign, aligned_alloc and free in every loaded object whose path contains
// req->name_part at the hooks (slots that hold anything but the C library's functions are left).
int patch_object(struct dl_phdr_info* info, size_t, void* data) {
  auto* req = static_cast<HookRequest*>(data);
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, req->name_part) == nullptr) return 0;
  ++req->found;
  const ElfW(Dyn)* dyn = nullptr;
  uintptr_t relro_start = 0, relro_end = 0, lo = UINTPTR_MAX, hi = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_DYNAMIC) dyn = reinterpret_cast<const ElfW(Dyn)*>(start);
    if (ph.p_type == PT_GNU_RELRO) relro_start = start, relro_end = start + ph.p_memsz;
    if (ph.p_type == PT_LOAD) {
      if (start < lo) lo = start;
      if (start + ph.p_memsz > hi) hi = start + ph.p_memsz;
    }
  }
  if (dyn == nullptr) return 0;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const ElfW(Rela)* tables[2] = {nullptr, nullptr};
  size_t sizes[2] = {0, 0};
  for (const ElfW(Dyn)* d = dyn; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {  // (glibc has already relocated these to absolute addresses)
      case DT_SYMTAB: symtab = reinterpret_cast<const ElfW(Sym)*>(d->d_un.d_ptr); break;
      case DT_STRTAB: strtab = reinterpret_cast<const char*>(d->d_un.d_ptr); break;
      case DT_JMPREL: tables[0] = reinterpret_cast<const ElfW(Rela)*>(d->d_un.d_ptr); break;
      case DT_PLTRELSZ: sizes[0] = d->d_un.d_val; break;
      case DT_RELA: tables[1] = reinterpret_cast<const ElfW(Rela)*>(d->d_un.d_ptr); break;
      case DT_RELASZ: sizes[1] = d->d_un.d_val; break;
      default: break;
    }
  }
  if (symtab == nullptr || strtab == nullptr) return 0;
  long page = sysconf(_SC_PAGESIZE);
  for (int t = 0; t < 2; ++t) {
    if (tables[t] == nullptr) continue;
    for (size_t k = 0; k < sizes[t] / sizeof(ElfW(Rela)); ++k) {
      const ElfW(Rela)& r = tables[t][k];
      unsigned type = ELF64_R_TYPE(r.r_info);
      if (type != kJumpSlot && type != kGlobDat) continue;
      const char* name = strtab + symtab[ELF64_R_SYM(r.r_info)].st_name;
      void* hook = nullptr;
      void* expected = nullptr;
      if (std::strcmp(name, "posix_memalign") == 0) {
        hook = reinterpret_cast<void*>(&hooked_posix_memalign);
        expected = reinterpret_cast<void*>(real_posix_memalign);
      } else if (std::strcmp(name, "aligned_alloc") == 0) {
        hook = reinterpret_cast<void*>(&hooked_aligned_alloc);
        expected = reinterpret_cast<void*>(real_aligned_alloc);
      } else if (std::strcmp(name, "free") == 0) {
        hook = reinterpret_cast<void*>(&hooked_free);
        expected = reinterpret_cast<void*>(real_free);
      } else {
        continue;
      }
      void** slot = reinterpret_cast<void**>(info->dlpi_addr + r.r_offset);
      uintptr_t target = reinterpret_cast<uintptr_t>(*slot);
      if (*slot == hook) {
        ++req->patched;
        continue;
      }
      // The C library's function, or (lazy binding, not called yet) the object's own PLT stub;
      // anything else is someone else's hook: leave it.
      if (*slot != expected && !(target >= lo && target < hi)) continue;
      uintptr_t addr = reinterpret_cast<uintptr_t>(slot);
      if (addr >= relro_start && addr < relro_end) {
        // RELRO (a BIND_NOW library's GOT): read-only after relocation; open its page for the write.
        uintptr_t start = addr & ~uintptr_t(page - 1);
        if (mprotect(reinterpret_cast<void*>(start), size_t(page), PROT_READ | PROT_WRITE) != 0) continue;
        __atomic_store_n(slot, hook, __ATOMIC_RELEASE);
        mprotect(reinterpret_cast<void*>(start), size_t(page), PROT_READ);
      } else {
        __atomic_store_n(slot, hook, __ATOMIC_RELEASE);  // a lazy-binding GOT stays writable
      }
      ++req->patched;
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// 1: the region is installed (or was already, by an outer bracket); 0: another allocator with a
// higher priority is installed, so nothing was swapped (the caller then needs no exit).
int ortwrap_region_enter() {
  std::lock_guard<std::mutex> guard(swap_mu);
  if (depth++ > 0) return 1;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != region.fallback) {
    // The first run, or someone installed another CPU allocator since the last one: serve small
    // blocks from it. Blocks an older one handed out keep their own deleters; only its raw pointers
    // freed through raw_deleter() would be misrouted, and PyTorch frees those through the DataPtr.
    region.fallback = current;
    fallback_raw_deleter = current->raw_deleter();
  }
  saved = current;
  // NOTE: c10 keeps the highest priority it was given: after the restore below, a later
  // SetCPUAllocator with a priority under 100 (none in torch itself) is ignored.
  c10::SetCPUAllocator(&region, /*priority=*/100);
  if (c10::GetCPUAllocator() != &region) {
    --depth;
    return 0;
  }
  active.store(depth);
  return 1;
}

void ortwrap_region_exit() {
  std::lock_guard<std::mutex> guard(swap_mu);
  if (depth <= 0 || --depth > 0) return;
  active.store(0);
  if (c10::GetCPUAllocator() == &region) c10::SetCPUAllocator(saved, /*priority=*/100);
}

// Route a library's large blocks to the region too (above): patch the loaded objects whose path
// contains name_part (idempotent). Returns the number of GOT slots that now point at the hooks (0: nothing matched).
int ortwrap_region_hook(const char* name_part) {
  std::lock_guard<std::mutex> guard(swap_mu);
  HookRequest req{name_part, 0, 0};
  dl_iterate_phdr(&patch_object, &req);
  return req.patched;
}

// PyTorch blocks served, requests refused, bytes in use, peak bytes in use, bytes of the region
// touched (top), bytes free inside it, number of free ranges, blocks served to ORT and the kernels
void ortwrap_region_stats(uint64_t* out) {
  std::lock_guard<std::mutex> guard(mu);
  uint64_t free_bytes = 0;
  for (auto& f : free_at) free_bytes += f.second;
  out[0] = n_region;
  out[1] = n_refused;
  out[2] = in_use;
  out[3] = peak_in_use;
  out[4] = top;
  out[5] = free_bytes;
  out[6] = free_at.size();
  out[7] = n_hooked;
}

// Give the pages of every free range back to the OS (the next use faults them in again). Returns
// the bytes released.
uint64_t ortwrap_region_release() {
  std::lock_guard<std::mutex> guard(mu);
  uint64_t released = 0;
  for (auto& f : free_at) {
    size_t end = f.first + f.second;
    if (end > committed) end = committed;
    if (end > f.first && madvise(base + f.first, end - f.first, MADV_DONTNEED) == 0) released += end - f.first;
  }
  return released;
}

}  // extern "C"
