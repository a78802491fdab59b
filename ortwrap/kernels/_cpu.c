/*
 * ortwrap's own CPU kernels, run inside ONNX Runtime graphs as `org.pytorch.aten::ATen` nodes whose operator is
 * "ortwrap_cpu::<name>" (see kernels/__init__.py for why, and passes/native_cpu_kernels.py for the rewrite).
 *
 * ORT 1.19.2's CPU kernels for a few ops that every transformer has are single-threaded, scalar, or split into many
 * memory-bound passes: LayerNormalizationGrad (one Eigen expression with four temporaries on one thread), the erf
 * GELU (a dozen elementwise kernels forward and backward), GatherNDGrad (a scalar loop with a 64-bit division per
 * element), SoftmaxCrossEntropyLoss (one thread), SoftmaxGrad.  These kernels compute the same functions in one
 * pass over the data, vectorized by the compiler (built with -O3 -march=native on the machine that runs them) and
 * split over a small fork-join thread pool.
 *
 * Entry point: ortwrap_cpu_run(op, used, n_in, in, n_out, out, err, err_len), called by the ATen executor (_aten.c)
 * without the GIL.  Inputs are ORT's tensors (borrowed: the caller releases them); outputs are allocated here and
 * handed over as DLManagedTensors whose deleter returns their memory to a block cache.  Returns 0, or -1 with a
 * message in `err`.
 *
 * float32 tensors, and bfloat16 where a kernel's signature says so (layer_norm_bf16, attention_bf16); every input is
 * checked.
 * Results are deterministic: work is split into chunks whose bounds depend only on the sizes, and reductions across
 * rows are summed per chunk and then in chunk order, whichever thread ran which chunk.
 *
 * The DLPack structs come from bridge/_dlpack.h, shared with _aten.c (the cache key covers it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../bridge/_dlpack.h"

#define MAX_DIMS 16

/* ------------------------------------------------------------------------------------------ memory */
/* Output buffers come from a small cache of freed blocks (exact sizes, most recent first). Fresh pages cost a
 * page fault each on first touch: measured inside a training process, ~11 ms to fill a new 4 MB GELU output,
 * 20x the kernel itself (ORT's own buffers come from its arena and do not pay this). The cache holds at most
 * CACHE_BYTES; blocks beyond that are freed.
 * NOTE: 32 MiB, was 1 GiB. In a backward the forward's stashed kernel outputs die one layer at a time and the
 * backward asks for other sizes, so the cache filled with blocks nothing took until the backward's end (97 MiB on
 * GPT-2 small under bf16 autocast), right at the step's peak. 32 MiB keeps a layer's transients for the next
 * layer; GPT-2 small's peak RSS fell 15-50 MiB on both routes, step time unchanged (docs/performance.md,
 * "The kernels' block cache, capped"). */
#define CACHE_SLOTS 256
#define CACHE_BYTES ((size_t)32 << 20)
static struct {
  pthread_mutex_t mu;
  size_t bytes;
  int count;
  void* ptr[CACHE_SLOTS];
  size_t size[CACHE_SLOTS];
} g_cache = {PTHREAD_MUTEX_INITIALIZER, 0, 0, {0}, {0}};

static void* block_get(size_t size) {
  pthread_mutex_lock(&g_cache.mu);
  for (int i = g_cache.count - 1; i >= 0; --i) {
    if (g_cache.size[i] != size) continue;
    void* p = g_cache.ptr[i];
    g_cache.bytes -= size;
    g_cache.count--;
    g_cache.ptr[i] = g_cache.ptr[g_cache.count];
    g_cache.size[i] = g_cache.size[g_cache.count];
    pthread_mutex_unlock(&g_cache.mu);
    return p;
  }
  pthread_mutex_unlock(&g_cache.mu);
  return aligned_alloc(64, size);
}

static void block_put(void* p, size_t size) {
  if (p == NULL) return;
  pthread_mutex_lock(&g_cache.mu);
  if (g_cache.count < CACHE_SLOTS && g_cache.bytes + size <= CACHE_BYTES) {
    g_cache.ptr[g_cache.count] = p;
    g_cache.size[g_cache.count] = size;
    g_cache.count++;
    g_cache.bytes += size;
    p = NULL;
  }
  pthread_mutex_unlock(&g_cache.mu);
  free(p);
}

static void (*g_gemm_release)(void);
static atomic_int g_gemm_used; /* an attention kernel ran since the last release */

/* Cached bytes, and release them all (tests; memory pressure; after each backward), with the buffers MKL keeps
 * for the attention kernels' GEMMs if one ran since (MKL frees only those no GEMM is using). */
size_t ortwrap_cpu_cached_bytes(int release) {
  if (release && g_gemm_release != NULL && atomic_exchange(&g_gemm_used, 0)) g_gemm_release();
  pthread_mutex_lock(&g_cache.mu);
  size_t bytes = g_cache.bytes;
  if (release) {
    for (int i = 0; i < g_cache.count; ++i) free(g_cache.ptr[i]);
    g_cache.count = 0;
    g_cache.bytes = 0;
  }
  pthread_mutex_unlock(&g_cache.mu);
  return bytes;
}

/* ------------------------------------------------------------------------------------------ thread pool */
/* A fork-join pool. A job is fn(ctx, chunk, chunks) for every chunk; the calling thread and the workers claim
 * chunks from one counter, so a worker that is slow to wake (its core busy, e.g. with PyTorch's OpenMP threads
 * spinning right after an optimizer step) never holds the caller up: the caller runs the chunks itself. Which
 * thread runs a chunk never changes a result: kernels write per-chunk partial sums and add them in chunk order.
 * Workers spin briefly after a job (a layer's kernels come close together), then sleep on a condition variable. */
typedef void (*chunk_fn)(void* ctx, int chunk, int chunks);

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

static struct {
  pthread_mutex_t mu;
  pthread_cond_t wake;
  int threads; /* wanted, including the caller */
  int started; /* workers running */
  uint64_t generation;
  chunk_fn fn;
  void* ctx;
  int chunks;
  _Atomic uint64_t ticket; /* (generation << 32) | next chunk: claims are only valid for the current job */
  atomic_int done;         /* chunks finished in the current job */
} g_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, 0, NULL, NULL, 0, 0, 0};

static pthread_mutex_t g_run_mu = PTHREAD_MUTEX_INITIALIZER; /* one job at a time (sessions may run concurrently) */

/* Claim and run chunks of job `generation` until none is left. */
static void run_chunks(uint64_t generation, chunk_fn fn, void* ctx, int chunks) {
  for (;;) {
    uint64_t t = atomic_load_explicit(&g_pool.ticket, memory_order_acquire);
    if ((t >> 32) != (generation & 0xffffffffu) || (int)(t & 0xffffffffu) >= chunks) return;
    if (!atomic_compare_exchange_weak_explicit(&g_pool.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire))
      continue;
    fn(ctx, (int)(t & 0xffffffffu), chunks);
    atomic_fetch_add_explicit(&g_pool.done, 1, memory_order_acq_rel);
  }
}

static void* worker_main(void* arg) {
  uint64_t seen = *(uint64_t*)arg; /* the generation when it was created: jobs after it are its to join */
  free(arg);
  for (;;) {
    for (int spins = 0; spins < 1000; ++spins) {
      if (__atomic_load_n(&g_pool.generation, __ATOMIC_ACQUIRE) != seen) break;
      CPU_RELAX();
    }
    pthread_mutex_lock(&g_pool.mu);
    while (g_pool.generation == seen) pthread_cond_wait(&g_pool.wake, &g_pool.mu);
    seen = g_pool.generation;
    chunk_fn fn = g_pool.fn;
    void* ctx = g_pool.ctx;
    int chunks = g_pool.chunks;
    pthread_mutex_unlock(&g_pool.mu);
    run_chunks(seen, fn, ctx, chunks);
  }
  return NULL;
}

static void after_fork_child(void) {
  /* the workers do not exist in a forked child: start over (they are created again on demand) */
  pthread_mutex_init(&g_pool.mu, NULL);
  pthread_cond_init(&g_pool.wake, NULL);
  pthread_mutex_init(&g_run_mu, NULL);
  pthread_mutex_init(&g_cache.mu, NULL);
  g_pool.started = 0;
}

static void ensure_workers(void) {
  static int atfork_done = 0;
  if (!atfork_done) {
    pthread_atfork(NULL, NULL, after_fork_child);
    atfork_done = 1;
  }
  while (g_pool.started < g_pool.threads - 1) {
    uint64_t* start = (uint64_t*)malloc(sizeof(uint64_t));
    if (start == NULL) return;
    *start = g_pool.generation; /* callers hold g_run_mu: no job is being published */
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, worker_main, start);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      free(start);
      return; /* fewer workers: the caller runs more chunks */
    }
    g_pool.started++;
  }
}

/* Set per run, on the thread that runs a graph (runtime/session.py): kernels called from a graph that ORT runs on one
 * intra-op thread (a graph of small kernels: gemm_choice.decide_pool) stay on that thread too. The results are the
 * same either way: chunk bounds depend only on the sizes. */
static __thread int t_serial = 0;

void ortwrap_cpu_set_serial(int serial) { t_serial = serial; }

/* Run fn(ctx, chunk, chunks) for every chunk in [0, chunks), on the pool; returns when all ran. */
static void parallel(chunk_fn fn, void* ctx, int chunks) {
  if (chunks <= 0) return;
  if (chunks == 1 || g_pool.threads <= 1 || t_serial) {
    for (int k = 0; k < chunks; ++k) fn(ctx, k, chunks);
    return;
  }
  pthread_mutex_lock(&g_run_mu);
  ensure_workers();
  pthread_mutex_lock(&g_pool.mu);
  uint64_t generation = g_pool.generation + 1;
  g_pool.fn = fn;
  g_pool.ctx = ctx;
  g_pool.chunks = chunks;
  atomic_store(&g_pool.done, 0);
  atomic_store(&g_pool.ticket, (generation & 0xffffffffu) << 32);
  __atomic_store_n(&g_pool.generation, generation, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&g_pool.wake);
  pthread_mutex_unlock(&g_pool.mu);
  run_chunks(generation, fn, ctx, chunks);
  while (atomic_load_explicit(&g_pool.done, memory_order_acquire) < chunks) CPU_RELAX();
  pthread_mutex_unlock(&g_run_mu);
}

/* Chunks for `work` elements: ~16k elements each, at most MAX_CHUNKS (also the partial-sum slots). */
#define MAX_CHUNKS 64
static int chunks_for(int64_t work, int64_t limit) {
  int64_t k = work / 16384;
  if (k > MAX_CHUNKS) k = MAX_CHUNKS;
  if (k > limit) k = limit;
  return k < 1 ? 1 : (int)k;
}

static void split(int64_t n, int part, int parts, int64_t* begin, int64_t* end) {
  *begin = n * part / parts;
  *end = n * (part + 1) / parts;
}

int ortwrap_cpu_set_threads(int threads) {
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  pthread_mutex_lock(&g_run_mu);
  if (threads > g_pool.threads) g_pool.threads = threads; /* grow only: running workers are never stopped */
  pthread_mutex_unlock(&g_run_mu);
  return g_pool.threads;
}

/* ------------------------------------------------------------------------------------------ tensors */
typedef struct {
  DLManagedTensor managed;
  int64_t shape[MAX_DIMS];
  size_t bytes; /* of the data block */
  int uncached; /* freed to the heap, not kept in the block cache */
} Owned;

static void owned_deleter(DLManagedTensor* self) {
  if (self == NULL) return;
  if (((Owned*)self)->uncached)
    free(self->dl_tensor.data);
  else
    block_put(self->dl_tensor.data, ((Owned*)self)->bytes);
  free(self);
}

static DLManagedTensor* new_tensor_in(int ndim, const int64_t* shape, uint8_t code, uint8_t bits, int uncached);

/* A new contiguous float32/int tensor of the given shape (data 64-byte aligned, uninitialized). */
static DLManagedTensor* new_tensor(int ndim, const int64_t* shape, uint8_t code, uint8_t bits) {
  return new_tensor_in(ndim, shape, code, bits, 0);
}

/* new_tensor whose memory comes from (and goes back to) the heap: outputs that live from a forward to its backward
 * (attention's), which the block cache would hold, unusable by anything else, until the end of the backward. */
static DLManagedTensor* new_tensor_in(int ndim, const int64_t* shape, uint8_t code, uint8_t bits, int uncached) {
  if (ndim > MAX_DIMS) return NULL;
  Owned* o = (Owned*)calloc(1, sizeof(Owned));
  if (o == NULL) return NULL;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    o->shape[i] = shape[i];
    n *= shape[i];
  }
  size_t bytes = (size_t)n * (bits / 8);
  size_t padded = bytes ? (bytes + 63) / 64 * 64 : 64;
  void* data = uncached ? aligned_alloc(64, padded) : block_get(padded);
  if (data == NULL) {
    free(o);
    return NULL;
  }
  o->bytes = padded;
  o->uncached = uncached;
  DLTensor* t = &o->managed.dl_tensor;
  t->data = data;
  t->device.device_type = kDLCPU;
  t->device.device_id = 0;
  t->ndim = ndim;
  t->dtype.code = code;
  t->dtype.bits = bits;
  t->dtype.lanes = 1;
  t->shape = o->shape;
  t->strides = NULL;
  t->byte_offset = 0;
  o->managed.manager_ctx = NULL;
  o->managed.deleter = owned_deleter;
  return &o->managed;
}

static int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

static int is_contiguous(const DLTensor* t) {
  if (t->strides == NULL) return 1;
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] != 1 && t->strides[i] != expect) return 0;
    expect *= t->shape[i];
  }
  return 1;
}

static void* data_of(const DLTensor* t) { return (char*)t->data + t->byte_offset; }

typedef struct {
  const char* op;
  char* err;
  size_t err_len;
} Call;

static int fail(Call* c, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = snprintf(c->err, c->err_len, "%s: ", c->op);
  if (k >= 0 && (size_t)k < c->err_len) vsnprintf(c->err + k, c->err_len - (size_t)k, fmt, ap);
  va_end(ap);
  return -1;
}

static int check(Call* c, DLManagedTensor* m, const char* name, uint8_t code, uint8_t bits, DLTensor** out) {
  if (m == NULL) return fail(c, "input %s is missing", name);
  DLTensor* t = &m->dl_tensor;
  if (t->device.device_type != kDLCPU) return fail(c, "input %s is not a CPU tensor", name);
  if (t->dtype.code != code || t->dtype.bits != bits || t->dtype.lanes != 1)
    return fail(c, "input %s has dtype code %d/%d bits, expected %d/%d", name, t->dtype.code, t->dtype.bits, code,
                bits);
  if (!is_contiguous(t)) return fail(c, "input %s is not contiguous", name);
  *out = t;
  return 0;
}

#define FLOAT_IN(idx, name, var)                                          \
  DLTensor* var;                                                          \
  if (check(c, (idx) < n_in ? in[idx] : NULL, name, kDLFloat, 32, &var)) \
  return -1
#define INT64_IN(idx, name, var)                                        \
  DLTensor* var;                                                        \
  if (check(c, (idx) < n_in ? in[idx] : NULL, name, kDLInt, 64, &var)) \
  return -1

static int same_shape(const DLTensor* a, const DLTensor* b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; ++i)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

/* ------------------------------------------------------------------------------------------ math */
/* exp(x) for x <= 0 (the only range used): Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for e^r
 * (the Cephes expf coefficients) and 2^n from the exponent bits. Relative error ~1e-7; 0 below -87.
 * Written branch-free so that loops calling it vectorize. */
static inline float exp_nonpos(float x) {
  float xc = x < -87.0f ? -87.0f : x;
  const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to the nearest integer */
  float n = (xc * 1.44269504088896341f + magic) - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  float e = p * scale;
  return x < -87.0f ? 0.0f : e;
}

/* Phi(x) = P(N(0,1) <= x) = 0.5 * (1 + erf(x / sqrt 2)), and phi(x) = exp(-x^2/2) / sqrt(2 pi).
 * erfc(a) for a >= 0 by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7): erfc(a) = t P(t) exp(-a^2),
 * t = 1 / (1 + p a). */
static inline void normal_cdf_pdf(float x, float* cdf, float* pdf) {
  const float inv_sqrt2 = 0.70710678118654752f;
  float a = fabsf(x) * inv_sqrt2;
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  float g = exp_nonpos(-0.5f * x * x); /* exp(-a^2) */
  float half_erfc = 0.5f * t * poly * g;
  *cdf = x < 0.0f ? half_erfc : 1.0f - half_erfc;
  *pdf = 0.39894228040143268f * g;
}

/* ------------------------------------------------------------------------------------------ GELU */
typedef struct {
  const float* x;
  const float* dy;
  float* out;
  int64_t n;
} Elementwise;

static void gelu_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  float* restrict y = e->out;
  for (int64_t i = b; i < end; ++i) {
    float cdf, pdf;
    normal_cdf_pdf(x[i], &cdf, &pdf);
    y[i] = x[i] * cdf;
  }
}

static void gelu_backward_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  const float* restrict dy = e->dy;
  float* restrict dx = e->out;
  for (int64_t i = b; i < end; ++i) {
    float cdf, pdf;
    normal_cdf_pdf(x[i], &cdf, &pdf);
    dx[i] = dy[i] * (cdf + x[i] * pdf);
  }
}

/* The tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). With t = exp(-2|u|), both
 * 1 + tanh(u) (2/(1+t) for u >= 0, 2t/(1+t) below) and 1 - tanh(u)^2 = 4t/(1+t)^2 come without cancellation. */
#define GELU_BETA 0.79788456080286536f
#define GELU_KAPPA 0.044715f

static inline void tanh_terms(float u, float* one_plus, float* sech2) {
  const float t = exp_nonpos(-2.0f * fabsf(u));
  const float inv = 1.0f / (1.0f + t);
  *one_plus = (u < 0.0f ? 2.0f * t : 2.0f) * inv;
  *sech2 = 4.0f * t * inv * inv;
}

static void gelu_tanh_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  float* restrict y = e->out;
  for (int64_t i = b; i < end; ++i) {
    const float v = x[i];
    float one_plus, sech2;
    tanh_terms(GELU_BETA * (v + GELU_KAPPA * v * v * v), &one_plus, &sech2);
    y[i] = 0.5f * v * one_plus;
  }
}

static void gelu_tanh_backward_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  const float* restrict dy = e->dy;
  float* restrict dx = e->out;
  for (int64_t i = b; i < end; ++i) {
    const float v = x[i];
    float one_plus, sech2;
    tanh_terms(GELU_BETA * (v + GELU_KAPPA * v * v * v), &one_plus, &sech2);
    const float du = GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * v * v);
    dx[i] = dy[i] * 0.5f * (one_plus + v * sech2 * du);
  }
}

/* An elementwise kernel: part(x) -> y, same shape. */
static int elementwise_op(Call* c, size_t n_in, DLManagedTensor** in, DLManagedTensor** out, chunk_fn part) {
  FLOAT_IN(0, "x", x);
  DLManagedTensor* y = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (y == NULL) return fail(c, "out of memory");
  Elementwise e = {data_of(x), NULL, y->dl_tensor.data, numel(x)};
  parallel(part, &e, chunks_for(e.n, MAX_CHUNKS));
  out[0] = y;
  return 0;
}

/* Its backward: part(dy, x) -> dx, same shape. */
static int elementwise_backward_op(Call* c, size_t n_in, DLManagedTensor** in, DLManagedTensor** out, chunk_fn part) {
  FLOAT_IN(0, "dy", dy);
  FLOAT_IN(1, "x", x);
  if (!same_shape(dy, x)) return fail(c, "dy and x have different shapes");
  DLManagedTensor* dx = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (dx == NULL) return fail(c, "out of memory");
  Elementwise e = {data_of(x), data_of(dy), dx->dl_tensor.data, numel(x)};
  parallel(part, &e, chunks_for(e.n, MAX_CHUNKS));
  out[0] = dx;
  return 0;
}

/* gelu(x) -> y; gelu_backward(dy, x) -> dx; gelu_tanh and gelu_tanh_backward the same */
static int op_gelu(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_op(c, n_in, in, out, gelu_part);
}
static int op_gelu_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_backward_op(c, n_in, in, out, gelu_backward_part);
}
static int op_gelu_tanh(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_op(c, n_in, in, out, gelu_tanh_part);
}
static int op_gelu_tanh_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_backward_op(c, n_in, in, out, gelu_tanh_backward_part);
}

/* ------------------------------------------------------------------------------------------ HardSwish, HardSigmoid */
/* PyTorch's formulas (ATen's CPU activation kernels), operation for operation: the same float results.
 * hardswish(x) = x * min(max(x + 3, 0), 6) / 6; its gradient dy * (x / 3 + 1/2) on (-3, 3), dy from 3, else 0.
 * hardsigmoid(x) = min(max(x + 3, 0), 6) / 6; its gradient dy / 6 on (-3, 3), 0 elsewhere. */
static inline float relu6(float t) { /* std::min(std::max(t, 0), 6): NaN stays NaN, as in PyTorch */
  const float r = t < 0.0f ? 0.0f : t;
  return 6.0f < r ? 6.0f : r;
}

static void hardswish_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  float* restrict y = e->out;
  for (int64_t i = b; i < end; ++i) {
    const float v = x[i];
    y[i] = v * relu6(v + 3.0f) / 6.0f;
  }
}

static void hardswish_backward_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  const float* restrict dy = e->dy;
  float* restrict dx = e->out;
  for (int64_t i = b; i < end; ++i) {
    const float v = x[i];
    const float mid = dy[i] * (v / 3.0f + 0.5f);
    dx[i] = v <= -3.0f ? 0.0f : (v < 3.0f ? mid : dy[i]);
  }
}

static void hardsigmoid_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  float* restrict y = e->out;
  for (int64_t i = b; i < end; ++i) y[i] = relu6(x[i] + 3.0f) / 6.0f;
}

static void hardsigmoid_backward_part(void* p, int part, int parts) {
  Elementwise* e = (Elementwise*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  const float* restrict dy = e->dy;
  float* restrict dx = e->out;
  const float one_sixth = 1.0f / 6.0f;
  for (int64_t i = b; i < end; ++i) dx[i] = dy[i] * ((x[i] > -3.0f && x[i] < 3.0f) ? one_sixth : 0.0f);
}

static int op_hardswish(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_op(c, n_in, in, out, hardswish_part);
}
static int op_hardswish_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_backward_op(c, n_in, in, out, hardswish_backward_part);
}
static int op_hardsigmoid(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_op(c, n_in, in, out, hardsigmoid_part);
}
static int op_hardsigmoid_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return elementwise_backward_op(c, n_in, in, out, hardsigmoid_backward_part);
}

/* ------------------------------------------------------------------------------------------ LayerNorm */
#define LANES 16

static inline float row_sum(const float* restrict v, int64_t m) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= m; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += v[i + j];
  float s = 0.0f;
  for (; i < m; ++i) s += v[i];
  for (int j = 0; j < LANES; ++j) s += acc[j];
  return s;
}

static inline float row_centered_sq(const float* restrict v, int64_t m, float mean) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= m; i += LANES)
    for (int j = 0; j < LANES; ++j) {
      float d = v[i + j] - mean;
      acc[j] += d * d;
    }
  float s = 0.0f;
  for (; i < m; ++i) {
    float d = v[i] - mean;
    s += d * d;
  }
  for (int j = 0; j < LANES; ++j) s += acc[j];
  return s;
}

/* The largest element of v[0..m), m >= 1. GCC vectorizes a float max only under -ffinite-math-only (which
 * would break the -inf of masked attention scores), so the x86 vector units are used explicitly. */
/* A row's mean (into *mean) and 1 / sqrt(var + eps): one definition for every norm kernel, so that a
 * backward that computes the statistics again gets the forward's bit for bit. */
static inline float row_rstd(const float* restrict v, int64_t m, float eps, float* mean) {
  *mean = row_sum(v, m) / (float)m;
  const float var = row_centered_sq(v, m, *mean) / (float)m;
  return 1.0f / sqrtf(var + eps);
}

/* sum(dy) and sum(dy * (x - mean)) over v[0..m): the two sums every norm backward takes of a row (lane-split,
 * then the tail, then the lanes: one order, so the norm kernels that share it add alike). */
static inline void row_dy_sums(const float* restrict dy, const float* restrict x, int64_t m, float mean, float* sum_dy,
                               float* sum_dyxc) {
  float s1[LANES] = {0}, s2[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= m; i += LANES)
    for (int j = 0; j < LANES; ++j) {
      s1[j] += dy[i + j];
      s2[j] += dy[i + j] * (x[i + j] - mean);
    }
  float a = 0.0f, b = 0.0f;
  for (; i < m; ++i) {
    a += dy[i];
    b += dy[i] * (x[i] - mean);
  }
  for (int j = 0; j < LANES; ++j) {
    a += s1[j];
    b += s2[j];
  }
  *sum_dy = a;
  *sum_dyxc = b;
}

static inline float row_max(const float* restrict v, int64_t m) {
  float mx = v[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (m >= 16) {
    __m512 acc = _mm512_loadu_ps(v);
    for (i = 16; i + 16 <= m; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(v + i));
    mx = _mm512_reduce_max_ps(acc);
  }
#elif defined(__AVX__)
  if (m >= 8) {
    __m256 acc = _mm256_loadu_ps(v);
    for (i = 8; i + 8 <= m; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(v + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    mx = lanes[0];
    for (int j = 1; j < 8; ++j) mx = lanes[j] > mx ? lanes[j] : mx;
  }
#endif
  for (; i < m; ++i) mx = v[i] > mx ? v[i] : mx;
  return mx;
}

/* bfloat16 <-> float32: round to nearest even, NaN kept a (quiet) NaN, as PyTorch converts. Plain integer
 * operations, which GCC vectorizes. */
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? ((u >> 16) | 0x40u) : rounded);
}
static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

typedef struct {
  const float *x, *w, *b, *dy, *mean_in, *rstd_in;
  const uint16_t* dy16; /* layer_norm_bf16_backward: dy in bfloat16 (dy is then NULL) */
  float *y, *mean, *rstd, *dx;
  uint16_t* y16;  /* layer_norm_bf16: y in bfloat16 (y is then NULL) */
  float* partial; /* backward: per part, dw then db (2*m floats), then a row of dy (m floats) for dy16 */
  int64_t rows, m;
  float eps;
} LayerNorm;

static void layer_norm_part(void* p, int part, int parts) {
  LayerNorm* L = (LayerNorm*)p;
  int64_t b, end;
  split(L->rows, part, parts, &b, &end);
  const int64_t m = L->m;
  const float* restrict w = L->w;
  const float* restrict bias = L->b;
  for (int64_t r = b; r < end; ++r) {
    const float* restrict x = L->x + r * m;
    float* restrict y = L->y + r * m;
    float mean;
    const float rstd = row_rstd(x, m, L->eps, &mean);
    L->mean[r] = mean;
    L->rstd[r] = rstd;
    if (L->y16 != NULL) {
      uint16_t* restrict y16 = L->y16 + r * m;
      if (bias != NULL) {
        for (int64_t i = 0; i < m; ++i) y16[i] = to_bf16((x[i] - mean) * rstd * w[i] + bias[i]);
      } else {
        for (int64_t i = 0; i < m; ++i) y16[i] = to_bf16((x[i] - mean) * rstd * w[i]);
      }
      continue;
    }
    if (bias != NULL) {
      for (int64_t i = 0; i < m; ++i) y[i] = (x[i] - mean) * rstd * w[i] + bias[i];
    } else {
      for (int64_t i = 0; i < m; ++i) y[i] = (x[i] - mean) * rstd * w[i];
    }
  }
}

static void layer_norm_backward_part(void* p, int part, int parts) {
  LayerNorm* L = (LayerNorm*)p;
  int64_t b, end;
  split(L->rows, part, parts, &b, &end);
  const int64_t m = L->m;
  const float* restrict w = L->w;
  const int64_t stride = L->dy16 != NULL ? 3 * m : 2 * m;
  float* restrict dw = L->partial + (int64_t)part * stride;
  float* restrict db = dw + m;
  float* restrict row = db + m; /* dy16's row in float32 */
  memset(dw, 0, sizeof(float) * 2 * (size_t)m);
  const float inv_m = 1.0f / (float)m;
  for (int64_t r = b; r < end; ++r) {
    const float* restrict x = L->x + r * m;
    if (L->dy16 != NULL) {
      const uint16_t* restrict h = L->dy16 + r * m;
      for (int64_t i = 0; i < m; ++i) row[i] = from_bf16(h[i]);
    }
    const float* restrict dy = L->dy16 != NULL ? row : L->dy + r * m;
    float* restrict dx = L->dx + r * m;
    const float mean = L->mean_in[r], rstd = L->rstd_in[r];
    float s1[LANES] = {0}, s2[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= m; i += LANES)
      for (int j = 0; j < LANES; ++j) {
        float xh = (x[i + j] - mean) * rstd;
        float g = dy[i + j] * w[i + j];
        s1[j] += g;
        s2[j] += g * xh;
        dw[i + j] += dy[i + j] * xh;
        db[i + j] += dy[i + j];
      }
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (; i < m; ++i) {
      float xh = (x[i] - mean) * rstd;
      float g = dy[i] * w[i];
      sum_g += g;
      sum_gx += g * xh;
      dw[i] += dy[i] * xh;
      db[i] += dy[i];
    }
    for (int j = 0; j < LANES; ++j) {
      sum_g += s1[j];
      sum_gx += s2[j];
    }
    const float mg = sum_g * inv_m, mgx = sum_gx * inv_m;
    for (int64_t k = 0; k < m; ++k) {
      float xh = (x[k] - mean) * rstd;
      dx[k] = rstd * (dy[k] * w[k] - mg - xh * mgx);
    }
  }
}

/* Reads the normalized size from axis: rows = prod(shape[:axis]), m = prod(shape[axis:]). */
static int ln_geometry(Call* c, const DLTensor* x, int64_t axis, int64_t* rows, int64_t* m) {
  if (axis < 0) axis += x->ndim;
  if (axis < 0 || axis >= x->ndim) return fail(c, "axis %lld out of range for a rank-%d input", (long long)axis, x->ndim);
  *rows = 1;
  *m = 1;
  for (int i = 0; i < x->ndim; ++i) {
    if (i < axis) *rows *= x->shape[i];
    else *m *= x->shape[i];
  }
  return 0;
}

static int scalar_f32(Call* c, size_t n_in, DLManagedTensor** in, size_t idx, const char* name, float* v) {
  FLOAT_IN(idx, name, t);
  if (numel(t) != 1) return fail(c, "%s must have one element", name);
  *v = *(const float*)data_of(t);
  return 0;
}

static int scalar_i64(Call* c, size_t n_in, DLManagedTensor** in, size_t idx, const char* name, int64_t* v) {
  INT64_IN(idx, name, t);
  if (numel(t) != 1) return fail(c, "%s must have one element", name);
  *v = *(const int64_t*)data_of(t);
  return 0;
}

/* ------------------------------------------------------------------------------------------ Clamps at their bounds */
/* clamp(x, lo, hi) (hardtanh, relu6, and clamp/clip/clamp_min/clamp_max with number bounds): PyTorch's clamp, NaN
 * stays NaN and a value equal to a bound is returned as is (-0.0 stays -0.0 at a bound 0); a NaN bound is an absent
 * one. Its gradient passes dy where lo < x < hi, 0 at a value equal to a bound (where ORT's Clip gradient passes it)
 * and at NaN (PyTorch's vectorized hardtanh_backward and clamp backward; its scalar loop, a tensor's last elements
 * past a multiple of the vector width, passes a NaN's gradient to hardtanh). */
typedef struct {
  const float* x;
  const float* dy;
  float* out;
  int64_t n;
  float lo, hi;
} Bounded;

static void clamp_part(void* p, int part, int parts) {
  Bounded* e = (Bounded*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  float* restrict y = e->out;
  const float lo = e->lo, hi = e->hi;
  for (int64_t i = b; i < end; ++i) {
    const float r = x[i] < lo ? lo : x[i];
    y[i] = hi < r ? hi : r;
  }
}

static void clamp_backward_part(void* p, int part, int parts) {
  Bounded* e = (Bounded*)p;
  int64_t b, end;
  split(e->n, part, parts, &b, &end);
  const float* restrict x = e->x;
  const float* restrict dy = e->dy;
  float* restrict dx = e->out;
  /* an absent (NaN) bound: -inf / inf, which only an infinite x of that sign equals */
  const float lo = e->lo == e->lo ? e->lo : -INFINITY, hi = e->hi == e->hi ? e->hi : INFINITY;
  const int open_lo = e->lo != e->lo, open_hi = e->hi != e->hi;
  for (int64_t i = b; i < end; ++i) {
    const float v = x[i];
    const int pass = (v > lo || (open_lo && v == lo)) && (v < hi || (open_hi && v == hi));
    dx[i] = pass ? dy[i] : 0.0f;
  }
}

/* clamp(x, lo, hi) -> y */
static int op_clamp(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "x", x);
  Bounded e = {data_of(x), NULL, NULL, numel(x), 0.0f, 0.0f};
  if (scalar_f32(c, n_in, in, 1, "lo", &e.lo) || scalar_f32(c, n_in, in, 2, "hi", &e.hi)) return -1;
  DLManagedTensor* y = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (y == NULL) return fail(c, "out of memory");
  e.out = y->dl_tensor.data;
  parallel(clamp_part, &e, chunks_for(e.n, MAX_CHUNKS));
  out[0] = y;
  return 0;
}

/* clamp_backward(dy, x, lo, hi) -> dx */
static int op_clamp_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "dy", dy);
  FLOAT_IN(1, "x", x);
  if (!same_shape(dy, x)) return fail(c, "dy and x have different shapes");
  Bounded e = {data_of(x), data_of(dy), NULL, numel(x), 0.0f, 0.0f};
  if (scalar_f32(c, n_in, in, 2, "lo", &e.lo) || scalar_f32(c, n_in, in, 3, "hi", &e.hi)) return -1;
  DLManagedTensor* dx = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (dx == NULL) return fail(c, "out of memory");
  e.out = dx->dl_tensor.data;
  parallel(clamp_backward_part, &e, chunks_for(e.n, MAX_CHUNKS));
  out[0] = dx;
  return 0;
}

/* layer_norm(x, weight, bias | absent, eps, axis) -> y, mean, rstd   (mean and rstd: shape[:axis] + 1s);
 * layer_norm_bf16: the same with y rounded to bfloat16 (the native bf16 route, passes/half_values.py) */
static int layer_norm_op(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out, int bf16) {
  FLOAT_IN(0, "x", x);
  FLOAT_IN(1, "weight", w);
  DLTensor* b = NULL;
  if (n_in > 2 && in[2] != NULL && check(c, in[2], "bias", kDLFloat, 32, &b)) return -1;
  float eps = 0.0f;
  int64_t axis = 0, rows = 0, m = 0;
  if (scalar_f32(c, n_in, in, 3, "eps", &eps) || scalar_i64(c, n_in, in, 4, "axis", &axis)) return -1;
  if (ln_geometry(c, x, axis, &rows, &m)) return -1;
  if (numel(w) != m || (b != NULL && numel(b) != m))
    return fail(c, "weight and bias must have the %lld elements of the normalized shape", (long long)m);
  if (n_out < 3) return fail(c, "expects 3 outputs");
  int64_t stat_shape[MAX_DIMS];
  if (axis < 0) axis += x->ndim;
  for (int i = 0; i < x->ndim; ++i) stat_shape[i] = i < axis ? x->shape[i] : 1;
  DLManagedTensor* y = bf16 ? new_tensor(x->ndim, x->shape, kDLBfloat, 16) : new_tensor(x->ndim, x->shape, kDLFloat, 32);
  DLManagedTensor* mean = new_tensor(x->ndim, stat_shape, kDLFloat, 32);
  DLManagedTensor* rstd = new_tensor(x->ndim, stat_shape, kDLFloat, 32);
  if (y == NULL || mean == NULL || rstd == NULL) {
    owned_deleter(y);
    owned_deleter(mean);
    owned_deleter(rstd);
    return fail(c, "out of memory");
  }
  LayerNorm L = {0};
  L.x = data_of(x);
  L.w = data_of(w);
  L.b = b ? data_of(b) : NULL;
  if (bf16) L.y16 = y->dl_tensor.data;
  else L.y = y->dl_tensor.data;
  L.mean = mean->dl_tensor.data;
  L.rstd = rstd->dl_tensor.data;
  L.rows = rows;
  L.m = m;
  L.eps = eps;
  parallel(layer_norm_part, &L, chunks_for(rows * m, rows));
  out[0] = y;
  out[1] = mean;
  out[2] = rstd;
  return 0;
}

static int op_layer_norm(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return layer_norm_op(c, n_in, in, n_out, out, 0);
}
static int op_layer_norm_bf16(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return layer_norm_op(c, n_in, in, n_out, out, 1);
}

/* layer_norm_backward(dy, x, weight, mean, rstd, axis) -> dx, dweight, dbias; layer_norm_bf16_backward: dy in
 * bfloat16 */
static int layer_norm_backward_op(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out,
                                  int bf16) {
  DLTensor* dy;
  if (check(c, 0 < n_in ? in[0] : NULL, "dy", bf16 ? kDLBfloat : kDLFloat, bf16 ? 16 : 32, &dy)) return -1;
  FLOAT_IN(1, "x", x);
  FLOAT_IN(2, "weight", w);
  FLOAT_IN(3, "mean", mean);
  FLOAT_IN(4, "rstd", rstd);
  int64_t axis = 0, rows = 0, m = 0;
  if (scalar_i64(c, n_in, in, 5, "axis", &axis)) return -1;
  if (ln_geometry(c, x, axis, &rows, &m)) return -1;
  if (!same_shape(dy, x)) return fail(c, "dy and x have different shapes");
  if (numel(w) != m || numel(mean) != rows || numel(rstd) != rows) return fail(c, "weight, mean or rstd has the wrong size");
  if (n_out < 3) return fail(c, "expects 3 outputs");
  /* few chunks: each one's dweight/dbias partial sums cost 2m floats, added in chunk order */
  int parts = chunks_for(rows * m / 4, rows);
  DLManagedTensor* dx = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  DLManagedTensor* dw = new_tensor(w->ndim, w->shape, kDLFloat, 32);
  DLManagedTensor* db = new_tensor(w->ndim, w->shape, kDLFloat, 32);
  const size_t stride = (bf16 ? 3 : 2) * (size_t)m;
  float* partial = (float*)malloc(sizeof(float) * stride * (size_t)parts + 64);
  if (dx == NULL || dw == NULL || db == NULL || partial == NULL) {
    owned_deleter(dx);
    owned_deleter(dw);
    owned_deleter(db);
    free(partial);
    return fail(c, "out of memory");
  }
  LayerNorm L = {0};
  L.x = data_of(x);
  L.w = data_of(w);
  if (bf16) L.dy16 = data_of(dy);
  else L.dy = data_of(dy);
  L.mean_in = data_of(mean);
  L.rstd_in = data_of(rstd);
  L.dx = dx->dl_tensor.data;
  L.partial = partial;
  L.rows = rows;
  L.m = m;
  parallel(layer_norm_backward_part, &L, parts);
  float* dwp = dw->dl_tensor.data;
  float* dbp = db->dl_tensor.data;
  memcpy(dwp, partial, sizeof(float) * (size_t)m);
  memcpy(dbp, partial + m, sizeof(float) * (size_t)m);
  for (int p = 1; p < parts; ++p) {
    const float* pw = partial + (int64_t)p * (int64_t)stride;
    for (int64_t i = 0; i < m; ++i) {
      dwp[i] += pw[i];
      dbp[i] += pw[m + i];
    }
  }
  free(partial);
  out[0] = dx;
  out[1] = dw;
  out[2] = db;
  return 0;
}
static int op_layer_norm_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return layer_norm_backward_op(c, n_in, in, n_out, out, 0);
}
static int op_layer_norm_bf16_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out,
                                       DLManagedTensor** out) {
  return layer_norm_backward_op(c, n_in, in, n_out, out, 1);
}

/* ------------------------------------------------------------------------------------------ instance norm */
/* instance_norm: ONNX InstanceNormalization, which is how both exporters write nn.GroupNorm (x reshaped to
 * [N, G, -1], scale ones, bias zeros; the affine Mul/Add follow) and nn.InstanceNorm*d: each row r = (n, c) of
 * x [N, C, *] is normalized over its m = prod(shape[2:]) elements, then y = xh * scale[c] + bias[c]. One kernel
 * each way instead of ORT's ~60 small nodes of the decomposition (passes/instance_norm.py). */
typedef struct {
  const float *x, *scale, *bias, *dy;
  float *y, *dx;
  float* row_sums; /* backward: per row, sum(dy) then sum(dy * xh) (2 * rows floats) */
  int64_t rows, channels, m;
  float eps;
} InstanceNorm;

static void instance_norm_part(void* p, int part, int parts) {
  InstanceNorm* L = (InstanceNorm*)p;
  int64_t b, end;
  split(L->rows, part, parts, &b, &end);
  const int64_t m = L->m;
  for (int64_t r = b; r < end; ++r) {
    const float* restrict x = L->x + r * m;
    float* restrict y = L->y + r * m;
    float mean;
    const float rstd = row_rstd(x, m, L->eps, &mean);
    const int64_t c = r % L->channels;
    const float a = rstd * L->scale[c], shift = L->bias[c];
    for (int64_t i = 0; i < m; ++i) y[i] = (x[i] - mean) * a + shift; /* centered first: no cancellation */
  }
}

static void instance_norm_backward_part(void* p, int part, int parts) {
  InstanceNorm* L = (InstanceNorm*)p;
  int64_t b, end;
  split(L->rows, part, parts, &b, &end);
  const int64_t m = L->m;
  const float inv_m = 1.0f / (float)m;
  for (int64_t r = b; r < end; ++r) {
    const float* restrict x = L->x + r * m;
    const float* restrict dy = L->dy + r * m;
    float* restrict dx = L->dx + r * m;
    /* the forward's statistics, computed again as it computes them (bit for bit): cheaper than saving them,
     * for which recompute="cheap" ran the whole forward kernel again in the backward */
    float mean;
    const float rstd = row_rstd(x, m, L->eps, &mean);
    float sum_dy, sum_dyxc;
    row_dy_sums(dy, x, m, mean, &sum_dy, &sum_dyxc);
    const float sum_dyxh = sum_dyxc * rstd;
    L->row_sums[2 * r] = sum_dy;
    L->row_sums[2 * r + 1] = sum_dyxh;
    /* dx = rstd * scale * (dy - mean(dy) - xh * mean(dy * xh)) = (dy - mean(dy)) * a + (x - mean) * k */
    const float a = rstd * L->scale[r % L->channels];
    const float k = -a * rstd * sum_dyxh * inv_m;
    const float mdy = sum_dy * inv_m;
    for (int64_t q = 0; q < m; ++q) dx[q] = (dy[q] - mdy) * a + (x[q] - mean) * k;
  }
}

/* Rows (N * C), channels (C) and the normalized size m = prod(shape[2:]) of an instance_norm input. */
static int in_geometry(Call* c, const DLTensor* x, int64_t* rows, int64_t* channels, int64_t* m) {
  if (x->ndim < 2) return fail(c, "x must have rank 2 or more, not %d", x->ndim);
  *rows = x->shape[0] * x->shape[1];
  *channels = x->shape[1];
  *m = 1;
  for (int i = 2; i < x->ndim; ++i) *m *= x->shape[i];
  if (*m < 1 || *channels < 1) return fail(c, "x has no elements to normalize");
  return 0;
}

/* instance_norm(x [N, C, *], scale [C], bias [C], eps) -> y */
static int op_instance_norm(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "x", x);
  FLOAT_IN(1, "scale", s);
  FLOAT_IN(2, "bias", b);
  float eps = 0.0f;
  int64_t rows = 0, channels = 0, m = 0;
  if (scalar_f32(c, n_in, in, 3, "eps", &eps)) return -1;
  if (in_geometry(c, x, &rows, &channels, &m)) return -1;
  if (numel(s) != channels || numel(b) != channels)
    return fail(c, "scale and bias must have the %lld elements of x's dimension 1", (long long)channels);
  DLManagedTensor* y = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (y == NULL) return fail(c, "out of memory");
  InstanceNorm L = {0};
  L.x = data_of(x);
  L.scale = data_of(s);
  L.bias = data_of(b);
  L.y = y->dl_tensor.data;
  L.rows = rows;
  L.channels = channels;
  L.m = m;
  L.eps = eps;
  if (rows > 0) parallel(instance_norm_part, &L, chunks_for(rows * m, rows));
  out[0] = y;
  return 0;
}

/* instance_norm_backward(dy, x, scale, eps) -> dx, dscale, dbias */
static int op_instance_norm_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out,
                                     DLManagedTensor** out) {
  FLOAT_IN(0, "dy", dy);
  FLOAT_IN(1, "x", x);
  FLOAT_IN(2, "scale", s);
  float eps = 0.0f;
  int64_t rows = 0, channels = 0, m = 0;
  if (scalar_f32(c, n_in, in, 3, "eps", &eps)) return -1;
  if (in_geometry(c, x, &rows, &channels, &m)) return -1;
  if (!same_shape(dy, x)) return fail(c, "dy and x have different shapes");
  if (numel(s) != channels) return fail(c, "scale must have the %lld elements of x's dimension 1", (long long)channels);
  DLManagedTensor* dx = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  DLManagedTensor* ds = new_tensor(s->ndim, s->shape, kDLFloat, 32);
  DLManagedTensor* db = new_tensor(s->ndim, s->shape, kDLFloat, 32);
  float* sums = (float*)malloc(sizeof(float) * 2 * (size_t)(rows > 0 ? rows : 1));
  if (dx == NULL || ds == NULL || db == NULL || sums == NULL) {
    owned_deleter(dx);
    owned_deleter(ds);
    owned_deleter(db);
    free(sums);
    return fail(c, "out of memory");
  }
  InstanceNorm L = {0};
  L.x = data_of(x);
  L.scale = data_of(s);
  L.dy = data_of(dy);
  L.dx = dx->dl_tensor.data;
  L.row_sums = sums;
  L.rows = rows;
  L.channels = channels;
  L.m = m;
  L.eps = eps;
  if (rows > 0) parallel(instance_norm_backward_part, &L, chunks_for(rows * m, rows));
  /* dscale[c] = sum over n of sum(dy * xh), dbias[c] = sum over n of sum(dy), in row order */
  float* dsp = ds->dl_tensor.data;
  float* dbp = db->dl_tensor.data;
  for (int64_t ch = 0; ch < channels; ++ch) dsp[ch] = dbp[ch] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    dbp[r % channels] += sums[2 * r];
    dsp[r % channels] += sums[2 * r + 1];
  }
  free(sums);
  out[0] = dx;
  out[1] = ds;
  out[2] = db;
  return 0;
}

/* ------------------------------------------------------------------------------------------ group norm */
/* group_norm: nn.GroupNorm with its affine, and the SiLU after it (silu = 1), in one kernel each way: what both
 * exporters write as Reshape [N, G, -1], InstanceNormalization (scale ones, bias zeros), Reshape back, Mul gamma,
 * Add beta (then Sigmoid, Mul): ~25 small nodes forward and backward per norm (the UNets' blocks). Row r = (n, g)
 * holds the C / G channels of group g, contiguous in x [N, C, *], normalized over their m = C / G * prod(shape[2:])
 * elements; z = (x - mean) * rstd * gamma[c] + beta[c]; y = z, or z * sigmoid(z). The backward computes the row
 * statistics again (row_rstd: the forward's bit for bit) and z with them. */
typedef struct {
  const float *x, *gamma, *beta, *dy;
  float *y, *dx;
  float* sums; /* backward: per (n, c), sum(dz) then sum(dz * xh) (2 * N * C floats) */
  int64_t rows, groups, cpg, hw; /* rows N * G; cpg = C / G channels a group; hw = prod(shape[2:]) */
  float eps;
  int silu;
} GroupNorm;

/* 1 / (1 + exp(-z)) without overflow, branch-free (vectorizes). */
static inline float sigmoid_f32(float z) {
  const float e = exp_nonpos(-fabsf(z));
  const float s = 1.0f / (1.0f + e);
  return z >= 0.0f ? s : e * s;
}

static void group_norm_part(void* p, int part, int parts) {
  GroupNorm* L = (GroupNorm*)p;
  int64_t b, end;
  split(L->rows, part, parts, &b, &end);
  const int64_t hw = L->hw, cpg = L->cpg, m = cpg * hw;
  for (int64_t r = b; r < end; ++r) {
    const float* restrict x = L->x + r * m;
    float* restrict y = L->y + r * m;
    float mean;
    const float rstd = row_rstd(x, m, L->eps, &mean);
    const int64_t c0 = (r % L->groups) * cpg;
    for (int64_t j = 0; j < cpg; ++j) {
      const float a = rstd * L->gamma[c0 + j], shift = L->beta[c0 + j];
      const float* restrict xc = x + j * hw;
      float* restrict yc = y + j * hw;
      if (L->silu) {
        for (int64_t i = 0; i < hw; ++i) {
          const float z = (xc[i] - mean) * a + shift;
          yc[i] = z * sigmoid_f32(z);
        }
      } else {
        for (int64_t i = 0; i < hw; ++i) yc[i] = (xc[i] - mean) * a + shift;
      }
    }
  }
}

static void group_norm_backward_part(void* p, int part, int parts) {
  GroupNorm* L = (GroupNorm*)p;
  int64_t b, end;
  split(L->rows, part, parts, &b, &end);
  const int64_t hw = L->hw, cpg = L->cpg, m = cpg * hw;
  const float inv_m = 1.0f / (float)m;
  for (int64_t r = b; r < end; ++r) {
    const float* restrict x = L->x + r * m;
    const float* restrict dy = L->dy + r * m;
    float* restrict dx = L->dx + r * m;
    float mean;
    const float rstd = row_rstd(x, m, L->eps, &mean);
    const int64_t c0 = (r % L->groups) * cpg;
    float* sums = L->sums + 2 * r * cpg; /* channel n * C + c0 + j is r * cpg + j */
    float sum_dxh = 0.0f, sum_dxh_xh = 0.0f; /* over the row: dxh = dz * gamma */
    for (int64_t j = 0; j < cpg; ++j) {
      const float g = L->gamma[c0 + j];
      const float* restrict xc = x + j * hw;
      const float* restrict dz = dy + j * hw;
      if (L->silu) { /* dz = dy * s * (1 + z * (1 - s)), kept in dx for the second pass */
        float* restrict t = dx + j * hw;
        const float a = rstd * g, shift = L->beta[c0 + j];
        for (int64_t i = 0; i < hw; ++i) {
          const float z = (xc[i] - mean) * a + shift;
          const float s = sigmoid_f32(z);
          t[i] = dz[i] * s * (1.0f + z * (1.0f - s));
        }
        dz = t;
      }
      float sd, sdx;
      row_dy_sums(dz, xc, hw, mean, &sd, &sdx);
      sdx *= rstd; /* sum(dz * xh) */
      sums[2 * j] = sd;
      sums[2 * j + 1] = sdx;
      sum_dxh += g * sd;
      sum_dxh_xh += g * sdx;
    }
    /* dx = rstd * (dxh - mean(dxh) - xh * mean(dxh * xh)) = (dz * gamma - mean(dxh)) * rstd + (x - mean) * k
     * (the difference first: a group of one element gets dx = 0 exactly) */
    const float mdxh = sum_dxh * inv_m, k = -rstd * rstd * sum_dxh_xh * inv_m;
    for (int64_t j = 0; j < cpg; ++j) {
      const float g = L->gamma[c0 + j];
      const float* restrict xc = x + j * hw;
      const float* dz = L->silu ? dx + j * hw : dy + j * hw;
      float* dxc = dx + j * hw; /* (in place over dz on the SiLU path: elementwise) */
      for (int64_t i = 0; i < hw; ++i) dxc[i] = (dz[i] * g - mdxh) * rstd + (xc[i] - mean) * k;
    }
  }
}

/* The geometry of a group_norm call: x [N, C, *] with C divisible by groups, gamma (and beta) of C elements. */
static int gn_geometry(Call* c, const DLTensor* x, const DLTensor* gamma, int64_t groups, int64_t silu, GroupNorm* L) {
  if (x->ndim < 2) return fail(c, "x must have rank 2 or more, not %d", x->ndim);
  const int64_t channels = x->shape[1];
  if (groups < 1 || channels % groups != 0)
    return fail(c, "groups=%lld must divide x's %lld channels", (long long)groups, (long long)channels);
  if (numel(gamma) != channels) return fail(c, "gamma and beta must have the %lld elements of x's dimension 1", (long long)channels);
  if (silu != 0 && silu != 1) return fail(c, "silu must be 0 or 1, not %lld", (long long)silu);
  L->hw = 1;
  for (int i = 2; i < x->ndim; ++i) L->hw *= x->shape[i];
  L->groups = groups;
  L->cpg = channels / groups;
  L->rows = x->shape[0] * groups;
  L->silu = (int)silu;
  return 0;
}

/* group_norm(x [N, C, *], gamma [C], beta [C], eps, groups, silu) -> y */
static int op_group_norm(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "x", x);
  FLOAT_IN(1, "gamma", g);
  FLOAT_IN(2, "beta", b);
  float eps = 0.0f;
  int64_t groups = 0, silu = 0;
  if (scalar_f32(c, n_in, in, 3, "eps", &eps) || scalar_i64(c, n_in, in, 4, "groups", &groups) ||
      scalar_i64(c, n_in, in, 5, "silu", &silu))
    return -1;
  GroupNorm L = {0};
  if (gn_geometry(c, x, g, groups, silu, &L)) return -1;
  if (numel(b) != numel(g)) return fail(c, "gamma and beta must have the same number of elements");
  DLManagedTensor* y = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (y == NULL) return fail(c, "out of memory");
  L.x = data_of(x);
  L.gamma = data_of(g);
  L.beta = data_of(b);
  L.y = y->dl_tensor.data;
  L.eps = eps;
  const int64_t m = L.cpg * L.hw;
  if (L.rows > 0 && m > 0) parallel(group_norm_part, &L, chunks_for(L.rows * m, L.rows));
  out[0] = y;
  return 0;
}

/* group_norm_backward(dy, x, gamma, beta, eps, groups, silu) -> dx, dgamma, dbeta */
static int op_group_norm_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "dy", dy);
  FLOAT_IN(1, "x", x);
  FLOAT_IN(2, "gamma", g);
  FLOAT_IN(3, "beta", b);
  float eps = 0.0f;
  int64_t groups = 0, silu = 0;
  if (scalar_f32(c, n_in, in, 4, "eps", &eps) || scalar_i64(c, n_in, in, 5, "groups", &groups) ||
      scalar_i64(c, n_in, in, 6, "silu", &silu))
    return -1;
  GroupNorm L = {0};
  if (gn_geometry(c, x, g, groups, silu, &L)) return -1;
  if (numel(b) != numel(g)) return fail(c, "gamma and beta must have the same number of elements");
  if (!same_shape(dy, x)) return fail(c, "dy and x have different shapes");
  const int64_t channels = x->shape[1], n = x->shape[0];
  DLManagedTensor* dx = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  DLManagedTensor* dg = new_tensor(g->ndim, g->shape, kDLFloat, 32);
  DLManagedTensor* db = new_tensor(g->ndim, g->shape, kDLFloat, 32);
  float* sums = (float*)malloc(sizeof(float) * 2 * (size_t)(n * channels > 0 ? n * channels : 1));
  if (dx == NULL || dg == NULL || db == NULL || sums == NULL) {
    owned_deleter(dx);
    owned_deleter(dg);
    owned_deleter(db);
    free(sums);
    return fail(c, "out of memory");
  }
  L.x = data_of(x);
  L.gamma = data_of(g);
  L.beta = data_of(b);
  L.dy = data_of(dy);
  L.dx = dx->dl_tensor.data;
  L.sums = sums;
  L.eps = eps;
  const int64_t m = L.cpg * L.hw;
  if (L.rows > 0 && m > 0) parallel(group_norm_backward_part, &L, chunks_for(L.rows * m, L.rows));
  /* dgamma[c] = sum over n of sum(dz * xh), dbeta[c] = sum over n of sum(dz), in batch order */
  float* dgp = dg->dl_tensor.data;
  float* dbp = db->dl_tensor.data;
  for (int64_t ch = 0; ch < channels; ++ch) dgp[ch] = dbp[ch] = 0.0f;
  if (m > 0)
    for (int64_t q = 0; q < n * channels; ++q) {
      dbp[q % channels] += sums[2 * q];
      dgp[q % channels] += sums[2 * q + 1];
    }
  free(sums);
  out[0] = dx;
  out[1] = dg;
  out[2] = db;
  return 0;
}

/* ------------------------------------------------------------------------------------------ max pool */
/* max_pool: ONNX MaxPool over the spatial dimensions of x [N, C, H, W] or [N, C, W] (floor mode, any kernel,
 * stride, padding and dilation) without its int64 indices output, which ORT's gradient adds and fills at ~9x the cost of
 * the pooling. The backward finds each window's maximum again in x: PyTorch's choice (max_pool2d on CPU), the
 * first of equal maxima in row-major order, the last NaN where there is one, the window's first element where all
 * are -inf. Each (n, c) plane is one task in both directions. */
typedef struct {
  const float *x, *dy;
  float *y, *dx;
  int64_t planes, h, w, oh, ow;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  atomic_int failed; /* a backward chunk could not allocate its row scratch */
} MaxPool;

/* Along one axis of size n: the window of output o (stride s, padding p before, k taps d apart) clipped to the
 * axis, taps lo, lo + d, ... < hi (lo >= hi: none inside). */
static inline void axis_window(int64_t o, int64_t s, int64_t p, int64_t k, int64_t d, int64_t n, int64_t* lo,
                               int64_t* hi) {
  int64_t a = o * s - p;
  const int64_t end = a + (k - 1) * d + 1;
  if (a < 0) a += (-a + d - 1) / d * d;
  *lo = a;
  *hi = end < n ? end : n;
}

/* Window (i, j)'s maximum, one element at a time (NaN where it holds one; -inf where it holds no element of x),
 * and in *arg the offset in the plane of PyTorch's choice (above; -1: no element). */
static inline float window_max(const MaxPool* L, const float* restrict x, int64_t h0, int64_t h1, int64_t j,
                               int64_t* arg) {
  int64_t w0, w1;
  axis_window(j, L->sw, L->pw, L->kw, L->dw, L->w, &w0, &w1);
  float m = -INFINITY;
  int64_t best = h0 < h1 && w0 < w1 ? h0 * L->w + w0 : -1;
  for (int64_t r = h0; r < h1; r += L->dh)
    for (int64_t q = w0; q < w1; q += L->dw) {
      const float v = x[r * L->w + q];
      const int takes = (v > m) | (v != v);
      m = takes ? v : m;
      best = takes ? r * L->w + q : best;
    }
  *arg = best;
  return m;
}

/* Output row i of a plane: m[j] the maximum of window (i, j) and, where arg is given, arg[j] the offset of
 * PyTorch's choice (window_max). The elements are visited in row-major order and taken with selects, not
 * branches (which element wins is a coin toss per window on real activations): where a window is whole in W,
 * across the row's windows at once, one window element at a time (vectorized); the windows clipped at the left
 * and right edges one by one. */
static void pool_row(const MaxPool* L, const float* restrict x, int64_t i, float* restrict m, int64_t* restrict arg) {
  const int64_t W = L->w, sw = L->sw, pw = L->pw, span = (L->kw - 1) * L->dw + 1;
  int64_t h0, h1;
  axis_window(i, L->sh, L->ph, L->kh, L->dh, L->h, &h0, &h1);
  /* whole in W: j * sw - pw >= 0 and j * sw - pw + span <= W */
  int64_t jl = (pw + sw - 1) / sw, jh = W + pw - span >= 0 ? (W + pw - span) / sw + 1 : 0;
  if (jh > L->ow) jh = L->ow;
  if (jl > jh) jl = jh;
  for (int64_t j = jl; j < jh; ++j) {
    m[j] = -INFINITY;
    if (arg) arg[j] = h0 < h1 ? h0 * W + j * sw - pw : -1;
  }
  for (int64_t r = h0; r < h1; r += L->dh)
    for (int64_t t = 0; t < L->kw; ++t) {
      const int64_t off = r * W + t * L->dw - pw;
      const float* restrict xr = x + off;
      if (arg)
        for (int64_t j = jl; j < jh; ++j) {
          const float v = xr[j * sw];
          const int takes = (v > m[j]) | (v != v);
          m[j] = takes ? v : m[j];
          arg[j] = takes ? off + j * sw : arg[j];
        }
      else
        for (int64_t j = jl; j < jh; ++j) {
          const float v = xr[j * sw];
          m[j] = ((v > m[j]) | (v != v)) ? v : m[j];
        }
    }
  int64_t edge;
  for (int64_t j = 0; j < jl; ++j) {
    m[j] = window_max(L, x, h0, h1, j, &edge);
    if (arg) arg[j] = edge;
  }
  for (int64_t j = jh; j < L->ow; ++j) {
    m[j] = window_max(L, x, h0, h1, j, &edge);
    if (arg) arg[j] = edge;
  }
}

static void max_pool_part(void* p, int part, int parts) {
  MaxPool* L = (MaxPool*)p;
  int64_t b, end;
  split(L->planes, part, parts, &b, &end);
  const int64_t in_plane = L->h * L->w, out_plane = L->oh * L->ow;
  const int dense = L->kh == 2 && L->kw == 2 && L->sh == 2 && L->sw == 2 && L->ph == 0 && L->pw == 0 && L->dh == 1 &&
                    L->dw == 1;
  for (int64_t pl = b; pl < end; ++pl) {
    const float* restrict x = L->x + pl * in_plane;
    float* restrict y = L->y + pl * out_plane;
    if (!dense) {
      for (int64_t i = 0; i < L->oh; ++i) pool_row(L, x, i, y + i * L->ow, NULL);
      continue;
    }
    for (int64_t i = 0; i < L->oh; ++i) { /* nn.MaxPool2d(2): the four elements in one pass over the row */
      const float* restrict r0 = x + 2 * i * L->w;
      const float* restrict r1 = r0 + L->w;
      float* restrict yr = y + i * L->ow;
      for (int64_t j = 0; j < L->ow; ++j) {
        float a = r0[2 * j], v = r0[2 * j + 1];
        a = ((v > a) | (v != v)) ? v : a;
        v = r1[2 * j];
        a = ((v > a) | (v != v)) ? v : a;
        v = r1[2 * j + 1];
        yr[j] = ((v > a) | (v != v)) ? v : a;
      }
    }
  }
}

static void max_pool_backward_part(void* p, int part, int parts) {
  MaxPool* L = (MaxPool*)p;
  int64_t b, end;
  split(L->planes, part, parts, &b, &end);
  const int64_t in_plane = L->h * L->w, out_plane = L->oh * L->ow;
  float* m = (float*)malloc(sizeof(float) * (size_t)L->ow);
  int64_t* arg = (int64_t*)malloc(sizeof(int64_t) * (size_t)L->ow);
  if (m == NULL || arg == NULL) { /* (a row's scratch: ow values) */
    free(m);
    free(arg);
    L->failed = 1;
    return;
  }
  for (int64_t pl = b; pl < end; ++pl) {
    const float* restrict x = L->x + pl * in_plane;
    const float* restrict dy = L->dy + pl * out_plane;
    float* restrict dx = L->dx + pl * in_plane;
    memset(dx, 0, sizeof(float) * (size_t)in_plane);
    for (int64_t i = 0; i < L->oh; ++i) {
      pool_row(L, x, i, m, arg);
      /* in PyTorch's order: overlapping windows add their gradients output by output, row-major */
      for (int64_t j = 0; j < L->ow; ++j)
        if (arg[j] >= 0) dx[arg[j]] += dy[i * L->ow + j];
    }
  }
  free(m);
  free(arg);
}

/* The geometry of a max_pool call: x [N, C, H, W] and params [kh, kw, sh, sw, pad_top, pad_left, pad_bottom,
 * pad_right, dh, dw] (ONNX MaxPool's kernel_shape, strides, pads and dilations; floor mode); a 1-D pool's x
 * [N, C, W] is x [N, C, 1, W] with kh = sh = dh = 1 and no padding in H. */
static int mp_geometry(Call* c, const DLTensor* x, const DLTensor* params, MaxPool* L) {
  if (x->ndim != 4 && x->ndim != 3) return fail(c, "x must have rank 4 [N, C, H, W] or 3 [N, C, W], not %d", x->ndim);
  if (numel(params) != 10)
    return fail(c, "params must hold 10 values (kernel, strides, pads begin and end, dilations), not %lld",
                (long long)numel(params));
  const int64_t* q = data_of(params);
  L->kh = q[0], L->kw = q[1], L->sh = q[2], L->sw = q[3], L->ph = q[4], L->pw = q[5], L->dh = q[8], L->dw = q[9];
  const int64_t pb = q[6], pr = q[7];
  if (L->kh < 1 || L->kw < 1 || L->sh < 1 || L->sw < 1 || L->dh < 1 || L->dw < 1 || L->ph < 0 || L->pw < 0 || pb < 0 ||
      pr < 0)
    return fail(c, "kernel, strides and dilations must be positive and pads not negative");
  if (x->ndim == 3 && (L->kh != 1 || L->sh != 1 || L->dh != 1 || L->ph != 0 || pb != 0))
    return fail(c, "a 1-D pool (x of rank 3) takes kernel, stride and dilation 1 and no padding in H");
  L->planes = x->shape[0] * x->shape[1];
  L->h = x->ndim == 4 ? x->shape[2] : 1;
  L->w = x->shape[x->ndim - 1];
  const int64_t span_h = L->h + L->ph + pb - L->dh * (L->kh - 1) - 1, span_w = L->w + L->pw + pr - L->dw * (L->kw - 1) - 1;
  if (span_h < 0 || span_w < 0)
    return fail(c, "the %lldx%lld window (with dilation) is larger than the padded %lldx%lld input",
                (long long)L->kh, (long long)L->kw, (long long)L->h, (long long)L->w);
  L->oh = span_h / L->sh + 1;
  L->ow = span_w / L->sw + 1;
  return 0;
}

/* max_pool(x [N, C, H, W] or [N, C, W], params) -> y [N, C, oh, ow] or [N, C, ow] */
static int op_max_pool(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "x", x);
  INT64_IN(1, "params", params);
  MaxPool L = {0};
  if (mp_geometry(c, x, params, &L)) return -1;
  const int64_t shape[4] = {x->shape[0], x->shape[1], x->ndim == 4 ? L.oh : L.ow, L.ow};
  DLManagedTensor* y = new_tensor(x->ndim, shape, kDLFloat, 32);
  if (y == NULL) return fail(c, "out of memory");
  L.x = data_of(x);
  L.y = y->dl_tensor.data;
  if (L.planes > 0) parallel(max_pool_part, &L, chunks_for(L.planes * L.h * L.w, L.planes));
  out[0] = y;
  return 0;
}

/* max_pool_backward(dy, x, params) -> dx */
static int op_max_pool_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "dy", dy);
  FLOAT_IN(1, "x", x);
  INT64_IN(2, "params", params);
  MaxPool L = {0};
  if (mp_geometry(c, x, params, &L)) return -1;
  if (dy->ndim != x->ndim || dy->shape[0] != x->shape[0] || dy->shape[1] != x->shape[1] ||
      (x->ndim == 4 && dy->shape[2] != L.oh) || dy->shape[dy->ndim - 1] != L.ow)
    return fail(c, "dy must have the pooled shape [%lld, %lld, %lld, %lld] (no third value for a 1-D pool)",
                (long long)x->shape[0], (long long)x->shape[1], (long long)L.oh, (long long)L.ow);
  DLManagedTensor* dx = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (dx == NULL) return fail(c, "out of memory");
  L.x = data_of(x);
  L.dy = data_of(dy);
  L.dx = dx->dl_tensor.data;
  if (L.planes > 0) parallel(max_pool_backward_part, &L, chunks_for(L.planes * L.h * L.w, L.planes));
  if (L.failed) {
    owned_deleter(dx);
    return fail(c, "out of memory");
  }
  out[0] = dx;
  return 0;
}

/* ------------------------------------------------------------------------------------------ embedding */
typedef struct {
  const float* table;
  const float* dy;
  const int64_t* ids;
  float* out;
  int64_t count, rows, dim;
} Embedding;

static void embedding_part(void* p, int part, int parts) {
  Embedding* E = (Embedding*)p;
  int64_t b, end;
  split(E->count, part, parts, &b, &end);
  for (int64_t k = b; k < end; ++k)
    memcpy(E->out + k * E->dim, E->table + E->ids[k] * E->dim, sizeof(float) * (size_t)E->dim);
}

/* Each part owns a slice of the columns: every part reads all ids, the sums stay in index order. */
static void embedding_backward_part(void* p, int part, int parts) {
  Embedding* E = (Embedding*)p;
  int64_t c0, c1;
  split(E->dim, part, parts, &c0, &c1);
  for (int64_t r = 0; r < E->rows; ++r) memset(E->out + r * E->dim + c0, 0, sizeof(float) * (size_t)(c1 - c0));
  for (int64_t k = 0; k < E->count; ++k) {
    float* restrict dst = E->out + E->ids[k] * E->dim;
    const float* restrict src = E->dy + k * E->dim;
    for (int64_t j = c0; j < c1; ++j) dst[j] += src[j];
  }
}

/* The row of each index (Gather's semantics: -rows..-1 count from the end), in a new array the caller frees;
 * NULL (with the error set) if an index is out of range. */
static int64_t* resolve_ids(Call* c, const DLTensor* ids, int64_t rows) {
  const int64_t count = numel(ids);
  const int64_t* v = data_of(ids);
  int64_t* out = (int64_t*)malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
  if (out == NULL) {
    fail(c, "out of memory");
    return NULL;
  }
  for (int64_t k = 0; k < count; ++k) {
    int64_t r = v[k] < 0 ? v[k] + rows : v[k];
    if (r < 0 || r >= rows) {
      fail(c, "index %lld is out of range for an embedding table of %lld rows", (long long)v[k], (long long)rows);
      free(out);
      return NULL;
    }
    out[k] = r;
  }
  return out;
}

/* embedding(table, ids) -> table[ids]   (table: [rows, ...] float32; ids: int64 of any shape) */
static int op_embedding(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "weight", w);
  INT64_IN(1, "indices", ids);
  if (w->ndim < 1) return fail(c, "weight must have rank >= 1");
  if (ids->ndim + w->ndim - 1 > MAX_DIMS) return fail(c, "result rank too large");
  int64_t rows = w->shape[0], dim = numel(w) / (rows ? rows : 1), count = numel(ids);
  int64_t* resolved = resolve_ids(c, ids, rows);
  if (resolved == NULL) return -1;
  int64_t shape[MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < ids->ndim; ++i) shape[nd++] = ids->shape[i];
  for (int i = 1; i < w->ndim; ++i) shape[nd++] = w->shape[i];
  DLManagedTensor* y = new_tensor(nd, shape, kDLFloat, 32);
  if (y == NULL) {
    free(resolved);
    return fail(c, "out of memory");
  }
  Embedding E = {data_of(w), NULL, resolved, y->dl_tensor.data, count, rows, dim};
  parallel(embedding_part, &E, chunks_for(count * dim, count));
  free(resolved);
  out[0] = y;
  return 0;
}

/* embedding_backward(dy, ids, weight) -> dweight   (weight only gives the table's shape) */
static int op_embedding_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "dy", dy);
  INT64_IN(1, "indices", ids);
  FLOAT_IN(2, "weight", w);
  if (w->ndim < 1) return fail(c, "weight must have rank >= 1");
  int64_t rows = w->shape[0], dim = numel(w) / (rows ? rows : 1), count = numel(ids);
  if (numel(dy) != count * dim) return fail(c, "dy has %lld elements, expected %lld", (long long)numel(dy), (long long)(count * dim));
  int64_t* resolved = resolve_ids(c, ids, rows);
  if (resolved == NULL) return -1;
  DLManagedTensor* dw = new_tensor(w->ndim, w->shape, kDLFloat, 32);
  if (dw == NULL) {
    free(resolved);
    return fail(c, "out of memory");
  }
  Embedding E = {NULL, data_of(dy), resolved, dw->dl_tensor.data, count, rows, dim};
  /* chunks own column slices of at least 16 floats: every chunk reads all ids, the sums stay in index order */
  parallel(embedding_backward_part, &E, chunks_for(count * dim, dim / 16));
  free(resolved);
  out[0] = dw;
  return 0;
}

/* ------------------------------------------------------------------------------------------ softmax */
typedef struct {
  const float* x;  /* forward: x; backward: y */
  const float* dy; /* backward */
  float* out;
  int64_t rows, c;
} Softmax;

static void softmax_part(void* p, int part, int parts) {
  Softmax* S = (Softmax*)p;
  int64_t b, end;
  split(S->rows, part, parts, &b, &end);
  const int64_t c = S->c;
  for (int64_t i = b; i < end; ++i) {
    const float* restrict x = S->x + i * c;
    float* restrict y = S->out + i * c;
    const float mx = row_max(x, c);
    for (int64_t k = 0; k < c; ++k) y[k] = exp_nonpos(x[k] - mx);
    const float inv = 1.0f / row_sum(y, c);
    for (int64_t k = 0; k < c; ++k) y[k] *= inv;
  }
}

static void softmax_backward_part(void* p, int part, int parts) {
  Softmax* S = (Softmax*)p;
  int64_t b, end;
  split(S->rows, part, parts, &b, &end);
  const int64_t c = S->c;
  for (int64_t i = b; i < end; ++i) {
    const float* restrict y = S->x + i * c;
    const float* restrict dy = S->dy + i * c;
    float* restrict dx = S->out + i * c;
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= c; k += LANES)
      for (int j = 0; j < LANES; ++j) acc[j] += dy[k + j] * y[k + j];
    float dot = 0.0f;
    for (; k < c; ++k) dot += dy[k] * y[k];
    for (int j = 0; j < LANES; ++j) dot += acc[j];
    for (k = 0; k < c; ++k) dx[k] = y[k] * (dy[k] - dot);
  }
}

/* softmax(x) over the last dimension -> y */
static int op_softmax(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "x", x);
  if (x->ndim < 1) return fail(c, "x must have rank >= 1");
  const int64_t cols = x->shape[x->ndim - 1], rows = cols ? numel(x) / cols : 0;
  DLManagedTensor* y = new_tensor(x->ndim, x->shape, kDLFloat, 32);
  if (y == NULL) return fail(c, "out of memory");
  Softmax S = {data_of(x), NULL, y->dl_tensor.data, rows, cols};
  if (cols > 0) parallel(softmax_part, &S, chunks_for(rows * cols, rows));
  out[0] = y;
  return 0;
}

/* softmax_backward(dy, y) -> dx = y * (dy - sum(dy * y)) over the last dimension */
static int op_softmax_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "dy", dy);
  FLOAT_IN(1, "y", y);
  if (!same_shape(dy, y) || y->ndim < 1) return fail(c, "dy and y have different shapes");
  const int64_t cols = y->shape[y->ndim - 1], rows = cols ? numel(y) / cols : 0;
  DLManagedTensor* dx = new_tensor(y->ndim, y->shape, kDLFloat, 32);
  if (dx == NULL) return fail(c, "out of memory");
  Softmax S = {data_of(y), data_of(dy), dx->dl_tensor.data, rows, cols};
  if (cols > 0) parallel(softmax_backward_part, &S, chunks_for(rows * cols, rows));
  out[0] = dx;
  return 0;
}

/* ------------------------------------------------------------------------------------------ cross-entropy */
enum { kReduceNone = 0, kReduceMean = 1, kReduceSum = 2 };

typedef struct {
  const float* x;      /* forward: scores [n, c]; backward: log_prob [n, c] */
  const int64_t* y;    /* labels [n] */
  const float* dloss;  /* backward: the loss gradient (one value, or n for reduction none) */
  float* out;          /* forward: log_prob; backward: dscores */
  float* row_loss;     /* forward: -log_prob[i, y_i] per row (0 for ignored rows) */
  int64_t n, c, ignore;
  int reduction;
  float scale;         /* backward: dloss / count for mean, dloss for sum */
} CrossEntropy;

static void cross_entropy_part(void* p, int part, int parts) {
  CrossEntropy* E = (CrossEntropy*)p;
  int64_t b, end;
  split(E->n, part, parts, &b, &end);
  const int64_t c = E->c;
  for (int64_t i = b; i < end; ++i) {
    const float* restrict x = E->x + i * c;
    float* restrict lp = E->out + i * c;
    const float mx = row_max(x, c);
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= c; k += LANES)
      for (int j = 0; j < LANES; ++j) acc[j] += exp_nonpos(x[k + j] - mx);
    float sum = 0.0f;
    for (; k < c; ++k) sum += exp_nonpos(x[k] - mx);
    for (int j = 0; j < LANES; ++j) sum += acc[j];
    const float lse = mx + logf(sum);
    for (k = 0; k < c; ++k) lp[k] = x[k] - lse;
    const int64_t t = E->y[i];
    E->row_loss[i] = t == E->ignore ? 0.0f : -lp[t];
  }
}

static void cross_entropy_backward_part(void* p, int part, int parts) {
  CrossEntropy* E = (CrossEntropy*)p;
  int64_t b, end;
  split(E->n, part, parts, &b, &end);
  const int64_t c = E->c;
  for (int64_t i = b; i < end; ++i) {
    const float* restrict lp = E->x + i * c;
    float* restrict d = E->out + i * c;
    const int64_t t = E->y[i];
    if (t == E->ignore) {
      memset(d, 0, sizeof(float) * (size_t)c);
      continue;
    }
    const float scale = E->reduction == kReduceNone ? E->dloss[i] : E->scale;
    for (int64_t k = 0; k < c; ++k) d[k] = exp_nonpos(lp[k]) * scale;
    d[t] -= scale;
  }
}

static int check_labels(Call* c, const int64_t* y, int64_t n, int64_t classes, int64_t ignore, int64_t* count) {
  *count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (y[i] == ignore) continue;
    if (y[i] < 0 || y[i] >= classes)
      return fail(c, "target %lld is out of range for %lld classes", (long long)y[i], (long long)classes);
    ++*count;
  }
  return 0;
}

/* cross_entropy(scores [n, c], labels [n] (i64), ignore_index (i64), reduction (i64: 0 none, 1 mean, 2 sum))
 *   -> loss (scalar, or [n] for none), log_prob [n, c] */
static int op_cross_entropy(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "scores", x);
  INT64_IN(1, "labels", y);
  int64_t ignore = 0, reduction = 0, count = 0;
  if (scalar_i64(c, n_in, in, 2, "ignore_index", &ignore) || scalar_i64(c, n_in, in, 3, "reduction", &reduction))
    return -1;
  if (x->ndim != 2 || y->ndim != 1 || y->shape[0] != x->shape[0])
    return fail(c, "expects scores [n, c] and labels [n]");
  const int64_t n = x->shape[0], classes = x->shape[1];
  if (classes < 1) return fail(c, "scores have no classes");
  if (check_labels(c, data_of(y), n, classes, ignore, &count)) return -1;
  int64_t scalar_shape[1] = {0};
  DLManagedTensor* loss = reduction == kReduceNone ? new_tensor(1, &n, kDLFloat, 32) : new_tensor(0, scalar_shape, kDLFloat, 32);
  DLManagedTensor* lp = new_tensor(2, x->shape, kDLFloat, 32);
  float* rows = (float*)malloc(sizeof(float) * (size_t)(n ? n : 1));
  if (loss == NULL || lp == NULL || rows == NULL) {
    owned_deleter(loss);
    owned_deleter(lp);
    free(rows);
    return fail(c, "out of memory");
  }
  CrossEntropy E = {data_of(x), data_of(y), NULL, lp->dl_tensor.data, rows, n, classes, ignore, (int)reduction, 0};
  parallel(cross_entropy_part, &E, chunks_for(n * classes, n));
  float* l = loss->dl_tensor.data;
  if (reduction == kReduceNone) {
    memcpy(l, rows, sizeof(float) * (size_t)n);
  } else {
    double total = 0.0; /* in row order: deterministic */
    for (int64_t i = 0; i < n; ++i) total += rows[i];
    l[0] = reduction == kReduceMean ? (float)(total / (double)count) : (float)total; /* 0/0 = NaN, as in PyTorch */
  }
  free(rows);
  out[0] = loss;
  out[1] = lp;
  return 0;
}

/* cross_entropy_backward(dloss, log_prob, labels, ignore_index, reduction) -> dscores */
static int op_cross_entropy_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  FLOAT_IN(0, "dloss", dl);
  FLOAT_IN(1, "log_prob", lp);
  INT64_IN(2, "labels", y);
  int64_t ignore = 0, reduction = 0, count = 0;
  if (scalar_i64(c, n_in, in, 3, "ignore_index", &ignore) || scalar_i64(c, n_in, in, 4, "reduction", &reduction))
    return -1;
  if (lp->ndim != 2 || y->ndim != 1 || y->shape[0] != lp->shape[0]) return fail(c, "expects log_prob [n, c] and labels [n]");
  const int64_t n = lp->shape[0], classes = lp->shape[1];
  if (numel(dl) != (reduction == kReduceNone ? n : 1)) return fail(c, "dloss has %lld elements", (long long)numel(dl));
  if (check_labels(c, data_of(y), n, classes, ignore, &count)) return -1;
  DLManagedTensor* d = new_tensor(2, lp->shape, kDLFloat, 32);
  if (d == NULL) return fail(c, "out of memory");
  const float g = *(const float*)data_of(dl);
  CrossEntropy E = {data_of(lp), data_of(y), data_of(dl), d->dl_tensor.data, NULL, n, classes, ignore, (int)reduction,
                    reduction == kReduceMean ? g / (float)count : g};
  parallel(cross_entropy_backward_part, &E, chunks_for(n * classes, n));
  out[0] = d;
  return 0;
}

/* ------------------------------------------------------------------------------------------ dispatch */
/* ------------------------------------------------------------------------------------------ attention (bf16) */
/* Softmax attention on bfloat16 q, k^T, v, forward and backward, as eager autocast's (PyTorch's CPU flash
 * attention) computes it: the GEMMs read bf16 and accumulate in float32, the scores, softmax, log-sum-exp and
 * the score gradients are float32; P (for P V and dV = P^T dO) and dS (for dQ and dK) are rounded to bf16 before
 * their GEMMs, the results once at the end. Flash attention walks small key blocks with an online softmax and
 * spends most of its time outside its GEMMs; here each block of BQ query rows sees all of its keys at once:
 *
 *   forward, per (batch x head, row block): S = q k^T (GEMM, float32) -> one pass per row: scale, mask, max,
 *   exp, sum, P (unnormalized, bf16), lse -> O = P v / sum (GEMM, float32, then bf16);
 *   backward: S again and dP = dO v^T (GEMMs, float32) -> one pass per row: P = exp(S - lse), delta = dO . O,
 *   dS = P (dP - delta) (bf16) -> dQ = scale dS k, and dV += P^T dO, dK^T += scale q^T dS (float32 per head).
 *
 * Nothing T x T is kept between forward and backward (the backward recomputes S, one GEMM); the scratch is
 * BQ x S per thread. A causal mask (the exporters' lower-triangular one, found in the mask's values) skips the
 * key columns past each row block's last row: the GEMMs and passes do ~half the work.
 *
 * The GEMMs are MKL's cblas_gemm_bf16bf16f32 (bf16 inputs, float32 result; AMX where the CPU has it), which
 * PyTorch's x86 wheels bundle: ortwrap_cpu_set_bf16_gemm finds it in the loaded torch library; or, on CPUs other
 * than Intel's with AVX512-BF16, gemm16_own below (kernels/__init__.py chooses). Without either the attention
 * kernels refuse to run and the pass keeps PyTorch's flash attention. Deterministic: one thread per
 * (batch x head), fixed order within. */
typedef void (*gemm_bf16_fn)(int layout, int transa, int transb, int m, int n, int k, float alpha, const uint16_t* a,
                             int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc);
typedef int (*gemm_threads_fn)(int);
static gemm_bf16_fn g_gemm_bf16 = NULL;
static gemm_threads_fn g_gemm_threads = NULL;
static void (*g_gemm_release)(void) = NULL; /* frees MKL's idle packing buffers (4.3 MB per calling thread) */
enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define ATTN_WIDE __attribute__((target("prefer-vector-width=512"))) /* the row passes: 16 floats a step */
#else
#define ATTN_WIDE
#endif
/* query rows per block: fewer, larger GEMMs (MKL packs both operands of each) against the keys a causal mask
 * lets a block skip; 128 rows was fastest for 256 keys, 64 for 1024-2048 (GPT-2's attention, one thread) */
static inline int64_t attn_rows_per_block(int64_t s) { return s <= 256 ? 128 : 64; }
#define MASKED_BELOW (-1.0e30f) /* a mask value this low zeroes its probability whatever the score */

/* Find cblas_gemm_bf16bf16f32 in `library` (already loaded: PyTorch's); 0 if found. */
int ortwrap_cpu_set_bf16_gemm(const char* library) {
  void* h = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
  if (h == NULL) return -1;
  gemm_bf16_fn gemm = (gemm_bf16_fn)dlsym(h, "cblas_gemm_bf16bf16f32");
  gemm_threads_fn threads = (gemm_threads_fn)dlsym(h, "MKL_Set_Num_Threads_Local");
  if (gemm == NULL || threads == NULL) return -1;
  g_gemm_threads = threads;
  g_gemm_release = (void (*)(void))dlsym(h, "mkl_serv_free_buffers");
  g_gemm_bf16 = gemm;
  return 0;
}


/* ortwrap's own bf16 GEMM, for CPUs with AVX512-BF16 where MKL's cblas_gemm_bf16bf16f32 takes a slow path
 * (MKL dispatches its bf16 kernels by vendor: on an AMD EPYC with avx512_bf16 it ran ~90 GFLOP/s on the
 * attention's shapes, at its float32 rate, where PyTorch's oneDNN bf16 GEMM ran 160-200). VDPBF16PS multiplies
 * pairs of bf16 along k and adds both products into a float32 lane: A's pairs (A[i,2p], A[i,2p+1]) are broadcast
 * from A itself where they are adjacent (A stored [m, k], k even) or else from a packed [kp, m] (kp = ceil(k/2),
 * zero-padded); B's pairs (B[2p,j], B[2p+1,j]) are read 16 columns at a time from [kp, n rounded up to 32],
 * packed per call. The packing scratch is the thread's (reused, never shrunk: at most (m + n + 32) * k * 2
 * bytes, 0.3 MB on GPT-2's shapes). Reading A in place took GPT-2's attention from 22.1 to 19.6 ms. Sums in
 * float32 over k in order, two products at a time (as AMX's and MKL's bf16 kernels, in another order). Chosen
 * per process by kernels/__init__.py (`ortwrap_cpu_set_bf16_gemm_kind`). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define OWN_GEMM16 1
#define G16_MR 12 /* rows per micro-tile: 12 x 32 float32 accumulators = 24 zmm registers */
static __thread uint32_t* t_g16_pack;
static __thread size_t t_g16_cap;
static __thread int t_g16_failed; /* a GEMM found no scratch: the calling kernel part reports it (g16_failed) */

static inline uint32_t g16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* dst[p, c] = (X[2p, c], X[2p+1, c]) for X[r, c] = src[r * ld + c], r < k, c < cols; dst row stride dld,
 * columns up to dld zero-filled; odd k: the last pair's high half 0 */
static void g16_pack_rows(const uint16_t* src, int64_t ld, int64_t k, int64_t cols, uint32_t* dst, int64_t dld) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; 2 * p < k; ++p) {
    const uint16_t* r0 = src + 2 * p * ld;
    const uint16_t* r1 = 2 * p + 1 < k ? r0 + ld : NULL;
    uint32_t* d = dst + p * dld;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + c);
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(d + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(d + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
    for (; c < cols; ++c) d[c] = g16_pair(r0[c], r1 ? r1[c] : 0);
    for (; c < dld; ++c) d[c] = 0;
  }
}

/* dst[p, r] = (X[r, 2p], X[r, 2p+1]) for X[r, c] = src[r * ld + c], r < rows, c < k; columns up to dld zero */
static void g16_pack_cols(const uint16_t* src, int64_t ld, int64_t k, int64_t rows, uint32_t* dst, int64_t dld) {
  const int64_t kp = (k + 1) / 2, even = k / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = src + r * ld;
    for (int64_t p = 0; p < even; ++p) {
      uint32_t x;
      memcpy(&x, s + 2 * p, 4);
      dst[p * dld + r] = x;
    }
    if (even < kp) dst[even * dld + r] = s[k - 1];
  }
  for (int64_t p = 0; p < kp; ++p)
    for (int64_t r = rows; r < dld; ++r) dst[p * dld + r] = 0;
}

/* C[i0 + r, j0 + c] for r < MR, c < 32 (mask: the columns < n): alpha sum_p A(i, p) . Bp[p, j] + beta C, where
 * row r's pair p of A is the two bf16 at a + r * sr + p * sp */
static inline __attribute__((always_inline)) void g16_tile(const int MR, int64_t kp, const uint16_t* a, int64_t sr,
                                                           int64_t sp, const uint32_t* bp, int64_t np, float alpha,
                                                           float beta, float* c, int64_t ldc, __mmask16 m0,
                                                           __mmask16 m1) {
  __m512 acc[G16_MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + p * np);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + p * np + 16);
    const uint16_t* ar = a + p * sp;
    for (int r = 0; r < MR; ++r) {
      uint32_t pair;
      memcpy(&pair, ar + r * sr, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    __m512 y0 = _mm512_mul_ps(acc[r][0], va), y1 = _mm512_mul_ps(acc[r][1], va);
    if (beta != 0.0f) {
      y0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, cr), vb, y0);
      y1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, cr + 16), vb, y1);
    }
    _mm512_mask_storeu_ps(cr, m0, y0);
    _mm512_mask_storeu_ps(cr + 16, m1, y1);
  }
}

#define G16_TILE(R) \
  case R: g16_tile(R, kp, a16 + i * sr, sr, sp, bp + j, np, alpha, beta, c + i * ldc + j, ldc, m0, m1); break

/* the same contract as gemm16's (beta 0 does not read C) */
static void gemm16_own(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
                       int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = (k + 1) / 2, np = (n + 31) / 32 * 32;
  const size_t need = (size_t)kp * (size_t)(m + np);
  if (need > t_g16_cap) {
    uint32_t* grown = realloc(t_g16_pack, need * sizeof(uint32_t));
    if (grown == NULL) { /* skipped: the attention part that called it fails with "out of memory" */
      t_g16_failed = 1;
      return;
    }
    t_g16_pack = grown;
    t_g16_cap = need;
  }
  uint32_t* ap = t_g16_pack;          /* [kp, m] */
  uint32_t* bp = t_g16_pack + kp * m; /* [kp, np] */
  /* A's pairs: read in place where they are adjacent in memory (A stored [m, k], k even), else packed */
  const uint16_t* a16 = a;
  int64_t sr = lda, sp = 2;
  if (ta) { /* A stored [k, m] */
    g16_pack_rows(a, lda, k, m, ap, m);
    a16 = (const uint16_t*)ap, sr = 2, sp = 2 * m;
  } else if (k % 2) {
    g16_pack_cols(a, lda, k, m, ap, m);
    a16 = (const uint16_t*)ap, sr = 2, sp = 2 * m;
  }
  if (tb) /* B stored [n, k] */
    g16_pack_cols(b, ldb, k, n, bp, np);
  else
    g16_pack_rows(b, ldb, k, n, bp, np);
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t w = n - j < 32 ? n - j : 32;
    const __mmask16 m0 = (__mmask16)(w >= 16 ? 0xFFFF : (1u << w) - 1);
    const __mmask16 m1 = (__mmask16)(w >= 32 ? 0xFFFF : w > 16 ? (1u << (w - 16)) - 1 : 0);
    int64_t i = 0;
    for (; i + G16_MR <= m; i += G16_MR)
      g16_tile(G16_MR, kp, a16 + i * sr, sr, sp, bp + j, np, alpha, beta, c + i * ldc + j, ldc, m0, m1);
    switch (m - i) {
      G16_TILE(11); G16_TILE(10); G16_TILE(9); G16_TILE(8); G16_TILE(7); G16_TILE(6);
      G16_TILE(5); G16_TILE(4); G16_TILE(3); G16_TILE(2); G16_TILE(1);
      default: break;
    }
  }
}
#endif

static int g_gemm_own = 0; /* 1: gemm16_own, else MKL's */

/* whether a gemm16_own call of this thread found no scratch since the last call (then cleared) */
static inline int g16_failed(void) {
#ifdef OWN_GEMM16
  const int f = t_g16_failed;
  t_g16_failed = 0;
  return f;
#else
  return 0;
#endif
}

/* 1: ortwrap's own bf16 GEMM for the attention kernels, 0: MKL's; -1 if that one is not there (own: not compiled
 * for this CPU, no AVX512-BF16; MKL: not found in PyTorch's library) */
int ortwrap_cpu_set_bf16_gemm_kind(int own) {
#ifdef OWN_GEMM16
  if (own) {
    g_gemm_own = 1;
    return 0;
  }
#else
  if (own) return -1;
#endif
  if (g_gemm_bf16 == NULL) return -1;
  g_gemm_own = 0;
  return 0;
}

/* whether gemm16_own was compiled (this CPU has AVX512-BF16) */
int ortwrap_cpu_own_bf16_gemm(void) {
#ifdef OWN_GEMM16
  return 1;
#else
  return 0;
#endif
}

/* C[m x n] = alpha op(A) op(B) + beta C, row-major; ta/tb: A/B stored transposed */
static inline void gemm16(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
                          const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#ifdef OWN_GEMM16
  if (g_gemm_own) {
    gemm16_own(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#endif
  g_gemm_bf16(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, (int)m, (int)n, (int)k, alpha, a, (int)lda, b,
              (int)ldb, beta, c, (int)ldc);
}

/* Two layouts: heads-major, q [BH,T,D], kt [BH,D,S] (k transposed), v [BH,S,E], o and dout [BH,T,E]; or the
 * projections' own ("bthd"), q [B,T,H,D], k [B,S,H,D], v [B,S,H,E], o and dout [B,T,H,E]: a head's rows are then
 * H * width apart; each head's are copied into the thread's scratch (attn_gather) for the GEMMs, and its results
 * written back into the layout, so the graph needs no Transposes into heads and back. */
typedef struct {
  const uint16_t *q, *k, *v, *o, *dout;
  const float* mask;                     /* NULL, or at mask + mask_off[bh] + t * mask_rs + j * mask_cs */
  const int64_t* mask_off;
  int64_t mask_rs, mask_cs;
  const float* lse_in; /* backward: the forward's lse */
  uint16_t *out, *dq, *dk, *dv; /* dk: k's gradient in k's layout (kt's for heads-major) */
  float* lse;                    /* [BH, T] in both layouts */
  int64_t bh, t, s, d, e;
  int64_t heads; /* H (bthd) */
  int bthd;
  float scale;
  int causal;
  int failed; /* scratch allocation failed somewhere */
} Attention;

/* Offset of head bh's first row in a tensor of `rows` x `width` per head, and the distance between its rows */
static inline int64_t attn_off(const Attention* A, int64_t bh, int64_t rows, int64_t width) {
  return A->bthd ? ((bh / A->heads) * rows * A->heads + bh % A->heads) * width : bh * rows * width;
}
static inline int64_t attn_ld(const Attention* A, int64_t width) { return A->bthd ? A->heads * width : width; }

/* Head bh's rows of a [B, n, H, w] tensor copied to a contiguous [n, w] (bthd; rows H * w apart), or k's
 * transposed to [w, n] (`transpose`), so that every GEMM reads contiguous, heads-major operands: MKL packs
 * strided rows ~30% slower, and the copy of a head (a few tens of KB) stays in cache. */
static void attn_gather(const Attention* A, const uint16_t* src, int64_t n, int64_t w, int transpose,
                        uint16_t* restrict dst) {
  const int64_t ld = A->heads * w;
  if (transpose) { /* 16 source rows at a time: rows H * w apart fall in few L1 sets, 16 of them stay there */
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t i1 = i0 + 16 < n ? i0 + 16 : n;
      for (int64_t c = 0; c < w; ++c)
        for (int64_t i = i0; i < i1; ++i) dst[c * n + i] = src[i * ld + c];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) memcpy(dst + i * w, src + i * ld, (size_t)w * sizeof(uint16_t));
  }
}

/* query row t sees keys [0, valid) of the block's kv columns */
static inline int64_t attn_valid(const Attention* A, int64_t t, int64_t kv) {
  return A->causal ? (t + 1 < kv ? t + 1 : kv) : kv;
}

/* Row lengths padded to whole vectors: x[n..n16) = -inf (probability 0), n16 = n rounded up to 16, at most kv;
 * returns n16. */
static inline int64_t attn_pad(float* x, int64_t n, int64_t kv) {
  int64_t n16 = (n + 15) / 16 * 16;
  if (n16 > kv) n16 = kv;
  for (int64_t j = n; j < n16; ++j) x[j] = -INFINITY;
  return n16;
}

/* sum(a[c] * b[c]) of two bf16 rows, in float32 */
static inline float attn_dot16(const uint16_t* restrict a, const uint16_t* restrict b, int64_t n) {
  float acc[LANES] = {0};
  int64_t c = 0;
  for (; c + LANES <= n; c += LANES)
    for (int k = 0; k < LANES; ++k) acc[k] += from_bf16(a[c + k]) * from_bf16(b[c + k]);
  float s = 0.0f;
  for (; c < n; ++c) s += from_bf16(a[c]) * from_bf16(b[c]);
  for (int k = 0; k < LANES; ++k) s += acc[k];
  return s;
}

/* x[0..n) = s * scale + mask row */
static inline void attn_logits(const Attention* A, int64_t bh, int64_t t, float* restrict x, int64_t n) {
  const float scale = A->scale;
  if (A->mask == NULL) {
    for (int64_t j = 0; j < n; ++j) x[j] *= scale;
  } else {
    const float* restrict m = A->mask + A->mask_off[bh] + t * A->mask_rs;
    if (A->mask_cs == 1)
      for (int64_t j = 0; j < n; ++j) x[j] = x[j] * scale + m[j];
    else
      for (int64_t j = 0; j < n; ++j) x[j] = x[j] * scale + m[0];
  }
}

/* p[j] = exp(x[j] - mx) rounded to bf16, j < n; returns the float32 sum of the exps */
static inline float attn_exp_row(const float* restrict x, uint16_t* restrict p, int64_t n, float mx) {
  float acc[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int k = 0; k < LANES; ++k) {
      const float e = exp_nonpos(x[j + k] - mx);
      p[j + k] = to_bf16(e);
      acc[k] += e;
    }
  float s = 0.0f;
  for (; j < n; ++j) {
    const float e = exp_nonpos(x[j] - mx);
    p[j] = to_bf16(e);
    s += e;
  }
  for (int k = 0; k < LANES; ++k) s += acc[k];
  return s;
}

ATTN_WIDE static void attention_part(void* p, int part, int parts) {
  Attention* A = (Attention*)p;
  int64_t b0, b1;
  split(A->bh, part, parts, &b0, &b1);
  const int64_t T = A->t, S = A->s, D = A->d, E = A->e, BQ = attn_rows_per_block(S);
  size_t bytes = (size_t)BQ * S * (sizeof(float) + sizeof(uint16_t)) + (size_t)BQ * E * sizeof(float) +
                 BQ * sizeof(float);
  bytes = (bytes + 63) / 64 * 64;
  const size_t copies = A->bthd ? (size_t)(T * D + D * S + S * E) * sizeof(uint16_t) : 0; /* q, k^T, v of a head */
  bytes += (copies + 63) / 64 * 64;
  char* scratch = (char*)block_get(bytes);
  if (scratch == NULL) {
    A->failed = 1;
    return;
  }
  float* sc = (float*)scratch;                           /* [BQ, kv] scores */
  uint16_t* pr = (uint16_t*)(sc + (size_t)BQ * S);  /* [BQ, kv] probabilities, unnormalized */
  float* acc = (float*)(pr + (size_t)BQ * S);       /* [BQ, E] P v */
  float* inv = acc + (size_t)BQ * E;                /* [BQ] 1 / sum */
  uint16_t* cq = (uint16_t*)(scratch + (bytes - ((copies + 63) / 64 * 64))); /* bthd: the head's q, k^T, v */
  uint16_t* ck = cq + T * D;
  uint16_t* cv = ck + D * S;
  const int64_t ldo = attn_ld(A, E);
  int threads = g_gemm_threads ? g_gemm_threads(1) : 1;
  for (int64_t bh = b0; bh < b1; ++bh) {
    const uint16_t* q = A->q + attn_off(A, bh, T, D);
    const uint16_t* kt = A->k + attn_off(A, bh, A->bthd ? S : D, A->bthd ? D : S);
    const uint16_t* v = A->v + attn_off(A, bh, S, E);
    if (A->bthd) {
      attn_gather(A, q, T, D, 0, cq);
      attn_gather(A, kt, S, D, 1, ck);
      attn_gather(A, v, S, E, 0, cv);
      q = cq, kt = ck, v = cv;
    }
    uint16_t* out = A->out + attn_off(A, bh, T, E);
    float* lse = A->lse + bh * T;
    for (int64_t r0 = 0; r0 < T; r0 += BQ) {
      const int64_t rows = T - r0 < BQ ? T - r0 : BQ;
      const int64_t kv = A->causal ? (r0 + rows < S ? r0 + rows : S) : S;
      if (kv > 0 && D > 0) {
        gemm16(0, 0, rows, kv, D, 1.0f, q + r0 * D, D, kt, S, 0.0f, sc, kv);
      } else {
        for (int64_t j = 0; j < rows * kv; ++j) sc[j] = 0.0f;
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = r0 + i, n = attn_valid(A, t, kv);
        float* restrict x = sc + i * kv;
        uint16_t* restrict pi = pr + i * kv;
        attn_logits(A, bh, t, x, n);
        const int64_t n16 = attn_pad(x, n, kv);
        const float mx = n > 0 ? row_max(x, n16) : -INFINITY;
        if (mx == -INFINITY) { /* every key masked: output 0 (as flash attention's), lse +inf (P = 0 backward) */
          for (int64_t j = 0; j < kv; ++j) pi[j] = 0;
          inv[i] = 0.0f;
          lse[t] = INFINITY;
          continue;
        }
        const float l = attn_exp_row(x, pi, n16, mx);
        for (int64_t j = n16; j < kv; ++j) pi[j] = 0;
        inv[i] = 1.0f / l;
        lse[t] = mx + logf(l);
      }
      if (kv > 0 && E > 0) gemm16(0, 0, rows, E, kv, 1.0f, pr, kv, v, E, 0.0f, acc, E);
      for (int64_t i = 0; i < rows; ++i) {
        uint16_t* restrict o = out + (r0 + i) * ldo;
        const float* restrict a = acc + i * E;
        const float w = inv[i];
        if (kv > 0)
          for (int64_t c = 0; c < E; ++c) o[c] = to_bf16(a[c] * w);
        else
          for (int64_t c = 0; c < E; ++c) o[c] = 0;
      }
    }
  }
  if (g_gemm_threads) g_gemm_threads(threads);
  if (g16_failed()) A->failed = 1;
  block_put(scratch, bytes);
}

ATTN_WIDE static void attention_backward_part(void* p, int part, int parts) {
  Attention* A = (Attention*)p;
  int64_t b0, b1;
  split(A->bh, part, parts, &b0, &b1);
  const int64_t T = A->t, S = A->s, D = A->d, E = A->e, BQ = attn_rows_per_block(S);
  const int64_t dmax = D > E ? D : E;
  size_t bytes = (size_t)BQ * S * 2 * (sizeof(float) + sizeof(uint16_t)) + (size_t)BQ * dmax * sizeof(float) +
                 (size_t)S * (D + E) * sizeof(float);
  bytes = (bytes + 63) / 64 * 64;
  /* bthd: the head's q, k^T, v, out, dout */
  const size_t copies = A->bthd ? (size_t)(T * D + D * S + S * E + 2 * T * E) * sizeof(uint16_t) : 0;
  bytes += (copies + 63) / 64 * 64;
  char* scratch = (char*)block_get(bytes);
  if (scratch == NULL) {
    A->failed = 1;
    return;
  }
  float* sc = (float*)scratch;                          /* [BQ, kv] scores, then probabilities */
  float* dp = sc + (size_t)BQ * S;                 /* [BQ, kv] dO v^T */
  uint16_t* pr = (uint16_t*)(dp + (size_t)BQ * S); /* [BQ, kv] P (bf16) */
  uint16_t* ds = pr + (size_t)BQ * S;              /* [BQ, kv] dS (bf16) */
  float* dq = (float*)(ds + (size_t)BQ * S);       /* [BQ, D] */
  float* dv = dq + (size_t)BQ * dmax;              /* [S, E] */
  float* dk = dv + (size_t)S * E;                       /* [D, S]: k^T's gradient */
  uint16_t* cq = (uint16_t*)(scratch + (bytes - ((copies + 63) / 64 * 64)));
  uint16_t* ck = cq + T * D;
  uint16_t* cv = ck + D * S;
  uint16_t* co = cv + S * E;
  uint16_t* cg = co + T * E;
  const int64_t ldq = attn_ld(A, D), ldk = A->bthd ? attn_ld(A, D) : S, ldv = attn_ld(A, E);
  int threads = g_gemm_threads ? g_gemm_threads(1) : 1;
  for (int64_t bh = b0; bh < b1; ++bh) {
    const int64_t q_off = attn_off(A, bh, T, D), k_off = attn_off(A, bh, A->bthd ? S : D, A->bthd ? D : S);
    const uint16_t* q = A->q + q_off;
    const uint16_t* kt = A->k + k_off;
    const uint16_t* v = A->v + attn_off(A, bh, S, E);
    const uint16_t* o = A->o + attn_off(A, bh, T, E);
    const uint16_t* go = A->dout + attn_off(A, bh, T, E);
    if (A->bthd) {
      attn_gather(A, q, T, D, 0, cq);
      attn_gather(A, kt, S, D, 1, ck);
      attn_gather(A, v, S, E, 0, cv);
      attn_gather(A, o, T, E, 0, co);
      attn_gather(A, go, T, E, 0, cg);
      q = cq, kt = ck, v = cv, o = co, go = cg;
    }
    const float* lse = A->lse_in + bh * T;
    for (int64_t j = 0; j < S * E; ++j) dv[j] = 0.0f;
    for (int64_t j = 0; j < S * D; ++j) dk[j] = 0.0f;
    for (int64_t r0 = 0; r0 < T; r0 += BQ) {
      const int64_t rows = T - r0 < BQ ? T - r0 : BQ;
      const int64_t kv = A->causal ? (r0 + rows < S ? r0 + rows : S) : S;
      uint16_t* dqo = A->dq + q_off + r0 * ldq;
      if (kv == 0) {
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < D; ++c) dqo[i * ldq + c] = 0;
        continue;
      }
      if (D > 0) {
        gemm16(0, 0, rows, kv, D, 1.0f, q + r0 * D, D, kt, S, 0.0f, sc, kv);
      } else {
        for (int64_t j = 0; j < rows * kv; ++j) sc[j] = 0.0f;
      }
      if (E > 0) {
        gemm16(0, 1, rows, kv, E, 1.0f, go + r0 * E, E, v, E, 0.0f, dp, kv);
      } else {
        for (int64_t j = 0; j < rows * kv; ++j) dp[j] = 0.0f;
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = r0 + i, n = attn_valid(A, t, kv);
        float* restrict x = sc + i * kv;
        const float* restrict g = dp + i * kv;
        uint16_t* restrict pi = pr + i * kv;
        uint16_t* restrict si = ds + i * kv;
        const float m = lse[t];
        if (m == INFINITY) {
          for (int64_t j = 0; j < kv; ++j) pi[j] = si[j] = 0;
          continue;
        }
        const float delta = attn_dot16(go + t * E, o + t * E, E);
        attn_logits(A, bh, t, x, n);
        const int64_t n16 = attn_pad(x, n, kv);
        for (int64_t j = 0; j < n16; ++j) { /* (the scale goes into dS's GEMMs, as flash attention applies it) */
          const float pj = exp_nonpos(x[j] - m);
          pi[j] = to_bf16(pj);
          si[j] = to_bf16(pj * (g[j] - delta));
        }
        for (int64_t j = n16; j < kv; ++j) pi[j] = si[j] = 0;
      }
      if (E > 0) gemm16(1, 0, kv, E, rows, 1.0f, pr, kv, go + r0 * E, E, 1.0f, dv, E);
      if (D > 0) { /* dQ = scale dS (k^T)^T, dK^T += scale q^T dS */
        gemm16(0, 1, rows, D, kv, A->scale, ds, kv, kt, S, 0.0f, dq, D);
        gemm16(1, 0, D, kv, rows, A->scale, q + r0 * D, D, ds, kv, 1.0f, dk, S);
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = 0; c < D; ++c) dqo[i * ldq + c] = to_bf16(dq[i * D + c]);
    }
    uint16_t* dvo = A->dv + attn_off(A, bh, S, E);
    uint16_t* dko = A->dk + k_off;
    for (int64_t j = 0; j < S; ++j)
      for (int64_t c = 0; c < E; ++c) dvo[j * ldv + c] = to_bf16(dv[j * E + c]);
    if (A->bthd) { /* k's layout, [S, D] rows H * D apart, from k^T's gradient */
      for (int64_t j = 0; j < S; ++j)
        for (int64_t c = 0; c < D; ++c) dko[j * ldk + c] = to_bf16(dk[c * S + j]);
    } else {
      for (int64_t j = 0; j < S * D; ++j) dko[j] = to_bf16(dk[j]);
    }
  }
  if (g_gemm_threads) g_gemm_threads(threads);
  if (g16_failed()) A->failed = 1;
  block_put(scratch, bytes);
}

#define BF16_IN(idx, name, var)                                            \
  DLTensor* var;                                                           \
  if (check(c, (idx) < n_in ? in[idx] : NULL, name, kDLBfloat, 16, &var)) \
  return -1

/* Shapes of q [..., T, D], kt [..., D, S], v [..., S, E] (same leading dims; bthd: q [B, T, H, D], k [B, S, H, D],
 * v [B, S, H, E]), the optional float32 mask (broadcastable to [..., T, S], bthd: [B, H, T, S]: per-(batch x head)
 * offsets into it, row and column strides) and the scale;
 * the mask is dropped for `causal` where it is the exporters' lower-triangular one (0 on and below the diagonal,
 * <= MASKED_BELOW above: skipping those keys is exact). `mask_off` is malloc'ed (caller frees). */
static int attention_geometry(Call* c, size_t n_in, DLManagedTensor** in, size_t first, Attention* A,
                              int64_t** mask_off) {
  BF16_IN(first, "q", q);
  BF16_IN(first + 1, A->bthd ? "k" : "kt", kt);
  BF16_IN(first + 2, "v", v);
  const int r = q->ndim;
  int64_t lead[MAX_DIMS]; /* the scores' leading dims: [..., T, S] */
  if (A->bthd) {
    if (r != 4 || kt->ndim != 4 || v->ndim != 4)
      return fail(c, "q, k and v must be [B, T, H, D], [B, S, H, D], [B, S, H, E]");
    A->heads = q->shape[2];
    A->t = q->shape[1];
    A->d = q->shape[3];
    A->s = kt->shape[1];
    A->e = v->shape[3];
    if (kt->shape[0] != q->shape[0] || v->shape[0] != q->shape[0] || kt->shape[2] != A->heads ||
        v->shape[2] != A->heads || kt->shape[3] != A->d || v->shape[1] != A->s)
      return fail(c, "k must be [B, S, H, D] and v [B, S, H, E] for q [B, T, H, D]");
    lead[0] = q->shape[0];
    lead[1] = A->heads;
    A->bh = lead[0] * lead[1];
  } else {
    if (r < 2 || kt->ndim != r || v->ndim != r) return fail(c, "q, kt and v must have the same rank >= 2");
    int64_t bh = 1;
    for (int i = 0; i < r - 2; ++i) {
      if (kt->shape[i] != q->shape[i] || v->shape[i] != q->shape[i])
        return fail(c, "q, kt and v must have the same leading dimensions");
      lead[i] = q->shape[i];
      bh *= q->shape[i];
    }
    A->bh = bh;
    A->t = q->shape[r - 2];
    A->d = q->shape[r - 1];
    A->s = kt->shape[r - 1];
    A->e = v->shape[r - 1];
    if (kt->shape[r - 2] != A->d || v->shape[r - 2] != A->s)
      return fail(c, "kt must be [..., D, S] and v [..., S, E] for q [..., T, D]");
  }
  if (A->t > INT32_MAX || A->s > INT32_MAX || A->bthd * A->heads * (A->d > A->e ? A->d : A->e) > INT32_MAX ||
      A->d > INT32_MAX || A->e > INT32_MAX)
    return fail(c, "dimensions beyond 2^31 are not supported");
  A->q = data_of(q);
  A->k = data_of(kt);
  A->v = data_of(v);
  if (scalar_f32(c, n_in, in, first + 4, "scale", &A->scale)) return -1;
  A->mask = NULL;
  A->causal = 0;
  *mask_off = NULL;
  DLManagedTensor* mm = first + 3 < n_in ? in[first + 3] : NULL;
  if (mm == NULL) return 0;
  DLTensor* m;
  if (check(c, mm, "mask", kDLFloat, 32, &m)) return -1;
  if (m->ndim > r) return fail(c, "the mask has a higher rank than q");
  /* strides of the mask broadcast to [..., T, S] (right-aligned; size-1 dims stride 0) */
  int64_t stride[MAX_DIMS] = {0}, full[MAX_DIMS];
  for (int i = 0; i < r - 2; ++i) full[i] = lead[i];
  full[r - 2] = A->t;
  full[r - 1] = A->s;
  int64_t st = 1, lead_numel = 1;
  for (int i = m->ndim - 1; i >= 0; --i) {
    const int k = r - m->ndim + i;
    if (m->shape[i] != 1 && m->shape[i] != full[k]) return fail(c, "the mask does not broadcast to the scores");
    stride[k] = m->shape[i] == 1 ? 0 : st;
    if (k < r - 2 && m->shape[i] != 1) lead_numel *= m->shape[i];
    st *= m->shape[i];
  }
  const float* md = data_of(m);
  A->mask_rs = stride[r - 2];
  A->mask_cs = stride[r - 1];
  if (lead_numel == 1 && A->mask_rs == A->s && A->mask_cs == 1) { /* one [T, S] mask: causal? */
    int causal = 1;
    for (int64_t t = 0; t < A->t && causal; ++t) {
      const float* row = md + t * A->s;
      for (int64_t j = 0; j < A->s; ++j)
        if (j <= t ? row[j] != 0.0f : !(row[j] <= MASKED_BELOW)) {
          causal = 0;
          break;
        }
    }
    if (causal) {
      A->causal = 1;
      return 0;
    }
  }
  const int64_t bh = A->bh;
  int64_t* off = (int64_t*)malloc(sizeof(int64_t) * (size_t)(bh > 0 ? bh : 1));
  if (off == NULL) return fail(c, "out of memory");
  for (int64_t b = 0; b < bh; ++b) {
    int64_t rest = b, o = 0;
    for (int i = r - 3; i >= 0; --i) {
      o += (rest % full[i]) * stride[i];
      rest /= full[i];
    }
    off[b] = o;
  }
  A->mask = md;
  A->mask_off = off;
  *mask_off = off;
  return 0;
}

static int attention_chunks(const Attention* A) {
  int64_t k = A->bh < MAX_CHUNKS ? A->bh : MAX_CHUNKS;
  return k < 1 ? 1 : (int)k;
}

/* attention_bf16(q, kt, v, mask?, scale) -> out [..., T, E] (bf16), lse [..., T] (float32);
 * attention_bthd_bf16(q, k, v, mask?, scale) -> out [B, T, H, E], lse [B, H, T] */
static int attention_forward_op(Call* c, size_t n_in, DLManagedTensor** in, DLManagedTensor** out, int bthd) {
  if (g_gemm_bf16 == NULL && !g_gemm_own)
    return fail(c, "no bf16 GEMM (cblas_gemm_bf16bf16f32) was found in PyTorch's library");
  Attention A;
  memset(&A, 0, sizeof A);
  A.bthd = bthd;
  int64_t* mask_off;
  if (attention_geometry(c, n_in, in, 0, &A, &mask_off)) return -1;
  const DLTensor* q = &in[0]->dl_tensor;
  int64_t shape[MAX_DIMS], lse_shape[MAX_DIMS];
  for (int i = 0; i < q->ndim; ++i) shape[i] = lse_shape[i] = q->shape[i];
  shape[q->ndim - 1] = A.e;
  if (bthd) { /* [B, H, T] */
    lse_shape[1] = A.heads;
    lse_shape[2] = A.t;
  }
  DLManagedTensor* o = new_tensor_in(q->ndim, shape, kDLBfloat, 16, 1);
  DLManagedTensor* lse = new_tensor_in(q->ndim - 1, lse_shape, kDLFloat, 32, 1);
  if (o == NULL || lse == NULL) {
    owned_deleter(o);
    owned_deleter(lse);
    free(mask_off);
    return fail(c, "out of memory");
  }
  A.out = o->dl_tensor.data;
  A.lse = lse->dl_tensor.data;
  atomic_store(&g_gemm_used, 1);
  if (A.bh > 0 && A.t > 0) parallel(attention_part, &A, attention_chunks(&A));
  free(mask_off);
  if (A.failed) {
    owned_deleter(o);
    owned_deleter(lse);
    return fail(c, "out of memory");
  }
  out[0] = o;
  out[1] = lse;
  return 0;
}

/* attention_bf16_backward(dout, q, kt, v, out, lse, mask?, scale) -> dq, dkt, dv (bf16, the inputs' shapes);
 * attention_bthd_bf16_backward(dout, q, k, v, out, lse, mask?, scale) -> dq, dk, dv */
static int attention_backward_op(Call* c, size_t n_in, DLManagedTensor** in, DLManagedTensor** out, int bthd) {
  if (g_gemm_bf16 == NULL && !g_gemm_own)
    return fail(c, "no bf16 GEMM (cblas_gemm_bf16bf16f32) was found in PyTorch's library");
  BF16_IN(0, "dout", dout);
  BF16_IN(4, "out", o);
  FLOAT_IN(5, "lse", lse);
  /* q, k(t), v at 1..3, mask at 6, scale at 7: attention_geometry reads [q, kt, v, mask, scale] from `first` */
  DLManagedTensor* args[5] = {in[1], in[2], in[3], n_in > 6 ? in[6] : NULL, n_in > 7 ? in[7] : NULL};
  Attention A;
  memset(&A, 0, sizeof A);
  A.bthd = bthd;
  int64_t* mask_off;
  if (attention_geometry(c, 5, args, 0, &A, &mask_off)) return -1;
  const DLTensor* q = &in[1]->dl_tensor;
  const int r = q->ndim;
  if (dout->ndim != r || o->ndim != r || lse->ndim != r - 1 || numel(lse) != A.bh * A.t ||
      numel(dout) != A.bh * A.t * A.e || numel(o) != A.bh * A.t * A.e) {
    free(mask_off);
    return fail(c, "dout, out and lse do not match q, k and v");
  }
  A.dout = data_of(dout);
  A.o = data_of(o);
  A.lse_in = data_of(lse);
  DLManagedTensor* g[3] = {new_tensor_in(r, q->shape, kDLBfloat, 16, 1),
                           new_tensor_in(r, in[2]->dl_tensor.shape, kDLBfloat, 16, 1),
                           new_tensor_in(r, in[3]->dl_tensor.shape, kDLBfloat, 16, 1)};
  if (g[0] == NULL || g[1] == NULL || g[2] == NULL) A.failed = 1;
  if (!A.failed) {
    A.dq = g[0]->dl_tensor.data;
    A.dk = g[1]->dl_tensor.data;
    A.dv = g[2]->dl_tensor.data;
    if (A.t == 0) { /* no queries: dk, dv are 0 */
      memset(A.dk, 0, (size_t)numel(&g[1]->dl_tensor) * 2);
      memset(A.dv, 0, (size_t)numel(&g[2]->dl_tensor) * 2);
    } else if (A.bh > 0) {
      atomic_store(&g_gemm_used, 1);
      parallel(attention_backward_part, &A, attention_chunks(&A));
    }
  }
  free(mask_off);
  if (A.failed) {
    for (int i = 0; i < 3; ++i) owned_deleter(g[i]);
    return fail(c, "out of memory");
  }
  for (int i = 0; i < 3; ++i) out[i] = g[i];
  return 0;
}

static int op_attention_bf16(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return attention_forward_op(c, n_in, in, out, 0);
}
static int op_attention_bf16_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out,
                                      DLManagedTensor** out) {
  return attention_backward_op(c, n_in, in, out, 0);
}
static int op_attention_bthd_bf16(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out, DLManagedTensor** out) {
  return attention_forward_op(c, n_in, in, out, 1);
}
static int op_attention_bthd_bf16_backward(Call* c, size_t n_in, DLManagedTensor** in, size_t n_out,
                                           DLManagedTensor** out) {
  return attention_backward_op(c, n_in, in, out, 1);
}

typedef int (*op_fn)(Call*, size_t, DLManagedTensor**, size_t, DLManagedTensor**);
/* Each kernel's signature, as ortwrap/ops/kernels.py declares it (kernels.install compares the two when the library
 * loads): one character per input, then '>' and one per output; f float32 tensor, h bfloat16 tensor, i int64
 * tensor, F float32 scalar, I int64 scalar, '?' after an input: it may be absent. */
static const struct {
  const char* name;
  op_fn fn;
  const char* signature;
} kOps[] = {
    {"gelu", op_gelu, "f>f"},
    {"gelu_backward", op_gelu_backward, "ff>f"},
    {"gelu_tanh", op_gelu_tanh, "f>f"},
    {"gelu_tanh_backward", op_gelu_tanh_backward, "ff>f"},
    {"hardswish", op_hardswish, "f>f"},
    {"hardswish_backward", op_hardswish_backward, "ff>f"},
    {"hardsigmoid", op_hardsigmoid, "f>f"},
    {"hardsigmoid_backward", op_hardsigmoid_backward, "ff>f"},
    {"clamp", op_clamp, "fFF>f"},
    {"clamp_backward", op_clamp_backward, "ffFF>f"},
    {"layer_norm", op_layer_norm, "fff?FI>fff"},
    {"layer_norm_backward", op_layer_norm_backward, "fffffI>fff"},
    {"layer_norm_bf16", op_layer_norm_bf16, "fff?FI>hff"},
    {"layer_norm_bf16_backward", op_layer_norm_bf16_backward, "hffffI>fff"},
    {"group_norm", op_group_norm, "fffFII>f"},
    {"group_norm_backward", op_group_norm_backward, "ffffFII>fff"},
    {"instance_norm", op_instance_norm, "fffF>f"},
    {"max_pool", op_max_pool, "fi>f"},
    {"max_pool_backward", op_max_pool_backward, "ffi>f"},
    {"instance_norm_backward", op_instance_norm_backward, "fffF>fff"},
    {"embedding", op_embedding, "fi>f"},
    {"embedding_backward", op_embedding_backward, "fif>f"},
    {"softmax", op_softmax, "f>f"},
    {"softmax_backward", op_softmax_backward, "ff>f"},
    {"cross_entropy", op_cross_entropy, "fiII>ff"},
    {"cross_entropy_backward", op_cross_entropy_backward, "ffiII>f"},
    {"attention_bf16", op_attention_bf16, "hhhf?F>hf"},
    {"attention_bf16_backward", op_attention_bf16_backward, "hhhhhff?F>hhh"},
    {"attention_bthd_bf16", op_attention_bthd_bf16, "hhhf?F>hf"},
    {"attention_bthd_bf16_backward", op_attention_bthd_bf16_backward, "hhhhhff?F>hhh"},
};

/* The k-th kernel's name and signature (0 <= k); returns 0, or -1 past the end. */
int ortwrap_cpu_kernel(size_t k, const char** name, const char** signature) {
  if (k >= sizeof kOps / sizeof kOps[0]) return -1;
  *name = kOps[k].name;
  *signature = kOps[k].signature;
  return 0;
}

/* Input counts a signature allows (trailing optional inputs may be left out) and its output count. */
static void signature_counts(const char* sig, size_t* min_in, size_t* max_in, size_t* n_out) {
  size_t total = 0, required = 0, outs = 0;
  int after = 0;
  for (const char* p = sig; *p; ++p) {
    if (*p == '>') {
      after = 1;
    } else if (after) {
      ++outs;
    } else if (*p == '?') {
      required = required > 0 ? required - 1 : 0; /* the previous input is optional */
    } else {
      ++total;
      required = total;
    }
  }
  *min_in = required;
  *max_in = total;
  *n_out = outs;
}

/* op: the name after "ortwrap_cpu::". used: "" (every output), or "used=" and one '1'/'0' per output: outputs the
 * graph does not use (a gradient nobody needs is an unnamed output, which ORT refuses to be given) are left NULL.
 * Inputs stay owned by the caller. On failure no output is set. */
int ortwrap_cpu_run(const char* op, const char* used, size_t n_in, DLManagedTensor** in, size_t n_out,
                    DLManagedTensor** out, char* err, size_t err_len) {
  Call c = {op, err, err_len};
  for (size_t i = 0; i < n_out; ++i) out[i] = NULL;
  for (size_t k = 0; k < sizeof kOps / sizeof kOps[0]; ++k) {
    if (strcmp(op, kOps[k].name) != 0) continue;
    size_t min_in, max_in, want_out;
    signature_counts(kOps[k].signature, &min_in, &max_in, &want_out);
    if (n_out != want_out) return fail(&c, "the node has %zu outputs, the kernel makes %zu", n_out, want_out);
    if (n_in < min_in || n_in > max_in)
      return fail(&c, "the node has %zu inputs, the kernel takes %zu to %zu (%s)", n_in, min_in, max_in,
                  kOps[k].signature);
    int rc = kOps[k].fn(&c, n_in, in, n_out, out);
    const char* flags = strncmp(used, "used=", 5) == 0 ? used + 5 : NULL;
    for (size_t i = 0; i < n_out; ++i) {
      int drop = rc != 0 || (flags != NULL && i < strlen(flags) && flags[i] == '0');
      if (drop) {
        owned_deleter(out[i]);
        out[i] = NULL;
      }
    }
    return rc;
  }
  return fail(&c, "no such ortwrap CPU kernel");
}
