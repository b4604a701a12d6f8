/* Matrix-vector products of decode steps: y (T, N) = x (T, K) W^T for a few rows T,
 * W (N, K) row-major in float32, bfloat16 or int8. Built at first use with the
 * machine's C compiler for the CPU it runs on (foveal/kernels/native.py).
 *
 * At one row a decode step reads every weight once for two flops per weight, so it is
 * bound by memory bandwidth; from ~8 rows on the arithmetic counts as much. The fp32
 * kernel works in tiles of TILE_W weight rows by up to GROUP_ROWS input rows, summed
 * over K in vectors with one accumulator per pair: every weight vector loaded serves
 * all the tile's input rows and every input vector all its weight rows, each weight row
 * is read from memory once (the later groups of input rows find it in the cache), and
 * the next tile's weights are prefetched while this one computes. Measured over a
 * whole decode step's weights (docs/benchmarks.md, "Native decode kernels"): as fast
 * as oneDNN's fp32 GEMM at one row, 0.76-0.91x its time at 2-32 rows, equal at 48-64.
 * The bf16 kernel (compiled steps of 1-4 rows) takes one weight row at a time.
 * Either way a row's sums run in the same order whatever the number of rows, so a
 * row's result does not depend on the rows beside it.
 *
 * The int8 kernel is exact: int8 x int8 products summed in int32 with AVX-512
 * VNNI (x is offset to unsigned and the offset times the weight row's sum
 * subtracted), so its result equals any other exact int8 GEMM's bit for bit. It takes
 * one weight row at a time against GROUP_ROWS input rows.
 *
 * Threads: OpenMP over blocks of weight rows, in the process's OpenMP runtime
 * (the one torch loaded; same soname), so they share torch's thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Input rows whose accumulators a kernel keeps in registers at once. */
#define GROUP_ROWS 4
/* How far ahead of the loads the weight stream is prefetched, in bytes. */
#define PREFETCH_BYTES 2048

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#else
#define ISA 0
#endif

int foveal_isa(void) { return ISA; }
int foveal_group_rows(void) { return GROUP_ROWS; }

int foveal_has_int8(void) {
#if ISA == 512 && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* Prefetch the cache line at p with a hint (_MM_HINT_NTA / T0 / T1); nothing without SIMD. */
#if ISA
#define PREFETCH(p, HINT) _mm_prefetch((const char*)(p), HINT)
#else
#define PREFETCH(p, HINT) ((void)(p))
#endif

static inline void prefetch_rows(const void* key, const void* value, int64_t bytes) {
    for (int64_t byte = 0; byte < bytes; byte += 64) {
        PREFETCH((const char*)key + byte, _MM_HINT_T0);
        PREFETCH((const char*)value + byte, _MM_HINT_T0);
    }
}

/* ---------------------------------------------------------------- float32 / bf16 */

#if ISA == 512
typedef __m512 vec;
#define LANES 16
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload_bf16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec vset1(float v) { return _mm512_set1_ps(v); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vround(vec a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vpow2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  /* p * 2^n */
#elif ISA == 256
typedef __m256 vec;
#define LANES 8
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vset1(float v) { return _mm256_set1_ps(v); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vround(vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vpow2(vec p, vec n) {  /* p * 2^n, n integral in [-126, 127] */
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if ISA
/* exp(x) for x <= 0 (softmax terms), Cephes' single-precision polynomial: within a
 * few ulp of expf; below -87 it returns ~1e-38 instead of a denormal. */
static inline vec vexp(vec x) {
    x = vmax(x, vset1(-87.0f));
    vec n = vround(vfma(x, vset1(1.44269504088896341f), vzero()));
    vec r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    vec r2 = vfma(r, r, vzero());
    p = vfma(p, r2, r);
    p = vfma(vset1(1.0f), vset1(1.0f), p);  /* 1 + r + r^2 * poly */
    return vpow2(p, n);
}
#endif

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* One element as float32: the scalar tails of the vector loops. */
static inline float load_f32(const float* p) { return *p; }
static inline float load_bf16(const uint16_t* p) { return bf16_to_float(*p); }

/* Weight rows a tile kernel takes at once: a tile is TILE_W weight rows by up to
 * GROUP_ROWS input rows, one accumulator vector per pair (16 of the 32 AVX-512
 * registers; 8 of AVX2's 16). */
#if ISA == 512
#define TILE_W 4
#else
#define TILE_W 2
#endif

/* One tile: weight rows w (WR rows of K, consecutive) against input rows x (TR rows of
 * K), summed over K a vector at a time; out[t * stride + r] receives row t's product
 * with weight row r. Each weight vector loaded serves the TR input rows and each input
 * vector the WR weight rows (the empty asm statements keep both in registers: without
 * them GCC reloads the weight vector for every input row, and the loop, load-bound,
 * ran at half the speed). Meanwhile the next tile's weight rows, which follow these in
 * memory, are prefetched into L2 at the same offsets, so that a tile's memory reads
 * overlap the previous tile's arithmetic; every group of input rows issues the
 * prefetch again (measured faster than prefetching in the first group only). WR and
 * TR are constants at every call (CALL_ROWS), so the accumulators stay in registers. */
#if ISA
#define TILE_KERNEL(NAME, WTYPE, WLOAD, WSCALAR)                                              \
    static inline __attribute__((always_inline)) void NAME(                                  \
        const WTYPE* w, int64_t K, const float* x, float* out, int64_t stride,                \
        const int WR, const int TR) {                                                         \
        vec acc[GROUP_ROWS][TILE_W];                                                          \
        for (int t = 0; t < TR; t++)                                                          \
            for (int r = 0; r < WR; r++) acc[t][r] = vzero();                                 \
        int64_t k = 0;                                                                        \
        for (; k + LANES <= K; k += LANES) {                                                  \
            vec wv[TILE_W];                                                                   \
            for (int r = 0; r < WR; r++) {                                                    \
                PREFETCH(w + (WR + r) * K + k, _MM_HINT_T1);                                  \
                wv[r] = WLOAD(w + r * K + k);                                                 \
                __asm__("" : "+v"(wv[r]));                                                    \
            }                                                                                 \
            for (int t = 0; t < TR; t++) {                                                    \
                vec xv = vload_f32(x + t * K + k);                                            \
                __asm__("" : "+v"(xv));                                                       \
                for (int r = 0; r < WR; r++) acc[t][r] = vfma(wv[r], xv, acc[t][r]);          \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < TR; t++)                                                          \
            for (int r = 0; r < WR; r++) {                                                    \
                float s = vsum(acc[t][r]);                                                    \
                for (int64_t j = k; j < K; j++) s += WSCALAR(w + r * K + j) * x[t * K + j];   \
                out[t * stride + r] = s;                                                      \
            }                                                                                 \
    }
#else
#define TILE_KERNEL(NAME, WTYPE, WLOAD, WSCALAR)                                              \
    static inline void NAME(const WTYPE* w, int64_t K, const float* x, float* out,           \
                            int64_t stride, const int WR, const int TR) {                     \
        for (int t = 0; t < TR; t++)                                                          \
            for (int r = 0; r < WR; r++) {                                                    \
                float s = 0.0f;                                                               \
                for (int64_t j = 0; j < K; j++) s += WSCALAR(w + r * K + j) * x[t * K + j];   \
                out[t * stride + r] = s;                                                      \
            }                                                                                 \
    }
#endif

TILE_KERNEL(tile_f32, float, vload_f32, load_f32)

/* One weight row against TR input rows (bfloat16 weights): four accumulators per input
 * row over consecutive vectors of K hide the FMA latency, and the weight stream is
 * prefetched PREFETCH_BYTES ahead (non-temporal). For bf16 this beat the tile kernel
 * (the same loop over four weight rows at once): 0.73x its time at one row, 0.79x at two
 * over a decode step's weights; fp32 streams as fast either way. */
#if ISA
#define ROW_KERNEL(NAME, WTYPE, WLOAD, WSCALAR, ELEM_BYTES)                                  \
    static inline __attribute__((always_inline)) void NAME(                                 \
        const WTYPE* w, int64_t K, const float* x, float* out, int64_t stride, const int TR) { \
        vec acc[GROUP_ROWS][4];                                                             \
        for (int t = 0; t < TR; t++)                                                        \
            for (int u = 0; u < 4; u++) acc[t][u] = vzero();                                \
        int64_t k = 0;                                                                      \
        for (; k + 4 * LANES <= K; k += 4 * LANES) {                                        \
            for (int64_t b = 0; b < 4 * LANES * (ELEM_BYTES); b += 64)                      \
                PREFETCH((const char*)(w + k) + PREFETCH_BYTES + b, _MM_HINT_NTA);          \
            vec w0 = WLOAD(w + k), w1 = WLOAD(w + k + LANES);                               \
            vec w2 = WLOAD(w + k + 2 * LANES), w3 = WLOAD(w + k + 3 * LANES);               \
            for (int t = 0; t < TR; t++) {                                                  \
                const float* xt = x + t * K + k;                                            \
                acc[t][0] = vfma(w0, vload_f32(xt), acc[t][0]);                             \
                acc[t][1] = vfma(w1, vload_f32(xt + LANES), acc[t][1]);                     \
                acc[t][2] = vfma(w2, vload_f32(xt + 2 * LANES), acc[t][2]);                 \
                acc[t][3] = vfma(w3, vload_f32(xt + 3 * LANES), acc[t][3]);                 \
            }                                                                               \
        }                                                                                   \
        for (; k + LANES <= K; k += LANES) {                                                \
            vec w0 = WLOAD(w + k);                                                          \
            for (int t = 0; t < TR; t++)                                                    \
                acc[t][0] = vfma(w0, vload_f32(x + t * K + k), acc[t][0]);                  \
        }                                                                                   \
        for (int t = 0; t < TR; t++) {                                                      \
            float s = vsum(acc[t][0]) + vsum(acc[t][1]) + vsum(acc[t][2]) + vsum(acc[t][3]); \
            for (int64_t r = k; r < K; r++) s += WSCALAR(w + r) * x[t * K + r];             \
            out[t * stride] = s;                                                            \
        }                                                                                   \
    }
#else
#define ROW_KERNEL(NAME, WTYPE, WLOAD, WSCALAR, ELEM_BYTES)                                  \
    static inline void NAME(const WTYPE* w, int64_t K, const float* x, float* out,          \
                            int64_t stride, const int TR) {                                 \
        for (int t = 0; t < TR; t++) {                                                      \
            float s = 0.0f;                                                                 \
            for (int64_t r = 0; r < K; r++) s += WSCALAR(w + r) * x[t * K + r];             \
            out[t * stride] = s;                                                            \
        }                                                                                   \
    }
#endif

ROW_KERNEL(row_bf16, uint16_t, vload_bf16, load_bf16, 2)

/* Weight rows are handed to threads in blocks, each thread one contiguous range. */
#define ROW_BLOCK 16

/* A kernel over one group of ROWS <= GROUP_ROWS rows with a constant row count, so
 * that its accumulators stay in registers (with a variable count the compiler keeps
 * them in memory: ~15% slower). Trailing arguments go to the kernel. */
#define CALL_GROUP(KERNEL, ROWS, ...)                                                         \
    switch (ROWS) {                                                                           \
        case 1: KERNEL(__VA_ARGS__, 1); break;                                                \
        case 2: KERNEL(__VA_ARGS__, 2); break;                                                \
        case 3: KERNEL(__VA_ARGS__, 3); break;                                                \
        default: KERNEL(__VA_ARGS__, 4); break;                                               \
    }

/* The same over all T input rows, GROUP_ROWS at a time: the kernel's arguments may use
 * t0, the group's first row. */
#define CALL_ROWS(KERNEL, T, ...)                                                             \
    for (int64_t t0 = 0; t0 < (T); t0 += GROUP_ROWS)                                          \
        CALL_GROUP(KERNEL, (T) - t0 < GROUP_ROWS ? (T) - t0 : GROUP_ROWS, __VA_ARGS__)

/* Weight rows [n0, end) against the T rows of x into y (T, N): fp32 in tiles of TILE_W
 * weight rows (single rows for the remainder), bf16 a weight row at a time. Macros, not
 * functions: expanded in GEMV's loop body. Behind an inlined function boundary GCC
 * allocated the bf16 kernel's registers worse (1.12x the time at two rows). */
#define ROWS_F32(w, n0, end, K, x, T, y, N)                                                   \
    {                                                                                         \
        int64_t n = (n0);                                                                     \
        for (; n + TILE_W <= (end); n += TILE_W)                                              \
            CALL_ROWS(tile_f32, T, (w) + n * (K), K, (x) + t0 * (K), (y) + n + t0 * (N), N,   \
                      TILE_W)                                                                 \
        for (; n < (end); n++)                                                                \
            CALL_ROWS(tile_f32, T, (w) + n * (K), K, (x) + t0 * (K), (y) + n + t0 * (N), N, 1) \
    }

#define ROWS_BF16(w, n0, end, K, x, T, y, N)                                                  \
    for (int64_t n = (n0); n < (end); n++)                                                    \
        CALL_ROWS(row_bf16, T, (w) + n * (K), K, (x) + t0 * (K), (y) + n + t0 * (N), N)

/* OpenMP over blocks of ROW_BLOCK weight rows, ROWS over each. */
#define GEMV(NAME, WTYPE, ROWS)                                                               \
    void NAME(const WTYPE* w, int64_t N, int64_t K, const float* x, int64_t T, float* y) {    \
        int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;                                     \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t block = 0; block < blocks; block++) {                                    \
            int64_t end = (block + 1) * ROW_BLOCK < N ? (block + 1) * ROW_BLOCK : N;           \
            ROWS(w, block * ROW_BLOCK, end, K, x, T, y, N)                                    \
        }                                                                                     \
    }

/* y (T, N) float32 = x (T, K) float32 times W (N, K) float32, transposed. */
GEMV(foveal_gemv_f32, float, ROWS_F32)
/* The same with W in bfloat16 (raw 16-bit words); x stays float32. */
GEMV(foveal_gemv_bf16, uint16_t, ROWS_BF16)

/* ---------------------------------------------------------------- int8 (exact) */

#if ISA == 512 && defined(__AVX512VNNI__)
/* One weight row against T rows of x offset to unsigned (x + 128). The offset adds
 * 128 times the row's sum to each dot product: the first group of rows (first = 1)
 * sums it in the same pass into *correction, later groups reuse it. */
static inline __attribute__((always_inline)) void row_s8(const int8_t* w, int64_t K, const uint8_t* xu,
                                                          int32_t* out, int64_t stride,
                                                          int32_t* correction, int first,
                                                          const int T) {
    __m512i acc[GROUP_ROWS][2], off[2];
    const __m512i offset = _mm512_set1_epi8((char)0x80);  /* 128 as an unsigned byte */
    off[0] = off[1] = _mm512_setzero_si512();
    for (int64_t t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        PREFETCH(w + k + PREFETCH_BYTES, _MM_HINT_NTA);
        PREFETCH(w + k + PREFETCH_BYTES + 64, _MM_HINT_NTA);
        __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        if (first) {
            off[0] = _mm512_dpbusd_epi32(off[0], offset, w0);
            off[1] = _mm512_dpbusd_epi32(off[1], offset, w1);
        }
        for (int64_t t = 0; t < T; t++) {
            const uint8_t* xt = xu + t * K + k;
            acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], _mm512_loadu_si512(xt), w0);
            acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], _mm512_loadu_si512(xt + 64), w1);
        }
    }
    for (; k < K; k += 64) {  /* masked tail: absent bytes load as 0 on both sides */
        __mmask64 mask = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i w0 = _mm512_maskz_loadu_epi8(mask, w + k);
        if (first) off[0] = _mm512_dpbusd_epi32(off[0], offset, w0);
        for (int64_t t = 0; t < T; t++)
            acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], _mm512_maskz_loadu_epi8(mask, xu + t * K + k),
                                            w0);
    }
    if (first) *correction = _mm512_reduce_add_epi32(_mm512_add_epi32(off[0], off[1]));
    for (int64_t t = 0; t < T; t++)
        out[t * stride] = _mm512_reduce_add_epi32(_mm512_add_epi32(acc[t][0], acc[t][1])) - *correction;
}

/* y (T, N) int32 = xq (T, K) int8 times W (N, K) int8, transposed, exactly. */
int foveal_gemv_s8(const int8_t* w, int64_t N, int64_t K, const int8_t* xq, int64_t T,
                   int32_t* y) {
    uint8_t* xu = (uint8_t*)malloc((size_t)(T * K));
    if (!xu) return 1;
    for (int64_t i = 0; i < T * K; i++) xu[i] = (uint8_t)(xq[i] + 128);
    int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    #pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t end = (block + 1) * ROW_BLOCK < N ? (block + 1) * ROW_BLOCK : N;
        for (int64_t n = block * ROW_BLOCK; n < end; n++) {
            int32_t correction = 0;
            /* the first group sums the correction, the later ones reuse it */
            CALL_ROWS(row_s8, T, w + n * K, K, xu + t0 * K, y + n + t0 * N, N, &correction,
                      t0 == 0)
        }
    }
    free(xu);
    return 0;
}
#else
int foveal_gemv_s8(const int8_t* w, int64_t N, int64_t K, const int8_t* xq, int64_t T,
                   int32_t* y) {
    (void)w; (void)N; (void)K; (void)xq; (void)T; (void)y;
    return 2;  /* not built for this CPU: foveal_has_int8() is 0 */
}
#endif

/* ---------------------------------------------------------------- decode attention */

/* One new token per request (a pure decode step) over its paged context, with the
 * new K/V written into the cache first. q (B, H, D); k_new / v_new (B, Hkv, D); the
 * caches (num_slots, Hkv, D), slot s = block_tables[b][p / block_size] * block_size
 * + p % block_size for context position p; seq_lens (B,) context lengths after the
 * step. Query heads h * G .. h * G + G - 1 share KV head h (G = H / Hkv). window > 0:
 * only the last `window` positions are seen. Online softmax in float32 over chunks
 * of keys, each key read once for the G heads that share it; OpenMP over (request,
 * KV head). out (B, H, D) in the cache's dtype. What it saves is the SDPA backend's
 * ~20 torch ops per layer around the same arithmetic. */

#define KEY_CHUNK 32

static inline void store_f32(float* p, float v) { *p = v; }
static inline void store_bf16(uint16_t* p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);  /* round to nearest even (finite values) */
    *p = (uint16_t)(bits >> 16);
}

#if ISA
#define VEC_DOT(NAME, T, VLOAD, SLOAD)                                                      \
    static inline float NAME(const float* a, const T* b, int64_t D) {                       \
        vec acc = vzero();                                                                  \
        int64_t d = 0;                                                                      \
        for (; d + LANES <= D; d += LANES) acc = vfma(vload_f32(a + d), VLOAD(b + d), acc); \
        float s = vsum(acc);                                                                \
        for (; d < D; d++) s += a[d] * SLOAD(b + d);                                        \
        return s;                                                                           \
    }
#else
#define VEC_DOT(NAME, T, VLOAD, SLOAD)                                                      \
    static inline float NAME(const float* a, const T* b, int64_t D) {                       \
        float s = 0.0f;                                                                     \
        for (int64_t d = 0; d < D; d++) s += a[d] * SLOAD(b + d);                           \
        return s;                                                                           \
    }
#endif
VEC_DOT(dot_f32, float, vload_f32, load_f32)
VEC_DOT(dot_bf16, uint16_t, vload_bf16, load_bf16)

/* s[j] = exp(s[j] - top) for j < n; returns their sum. */
static inline float exp_shift(float* s, int64_t n, float top) {
    float sum = 0.0f;
    int64_t j = 0;
#if ISA
    for (; j + LANES <= n; j += LANES) {
        vec e = vexp(vsub(vload_f32(s + j), vset1(top)));
        vstore(s + j, e);
        sum += vsum(e);
    }
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    return sum;
}

/* a[0:D] += w * v[0:D] */
#define AXPY(NAME, T, VLOAD, SLOAD)                                                         \
    static inline void NAME(float* a, float w, const T* v, int64_t D) {                     \
        int64_t d = 0;                                                                      \
        AXPY_VECTOR(VLOAD)                                                                  \
        for (; d < D; d++) a[d] += w * SLOAD(v + d);                                        \
    }
#if ISA
#define AXPY_VECTOR(VLOAD)                                                                  \
    vec wv = vset1(w);                                                                      \
    for (; d + LANES <= D; d += LANES) vstore(a + d, vfma(wv, VLOAD(v + d), vload_f32(a + d)));
#else
#define AXPY_VECTOR(VLOAD)
#endif
AXPY(axpy_f32, float, vload_f32, load_f32)
AXPY(axpy_bf16, uint16_t, vload_bf16, load_bf16)

#define DECODE_ATTENTION(NAME, T, DOT, AXPY_T, SLOAD, SSTORE)                                \
    void NAME(const T* q, const T* k_new, const T* v_new, T* k_cache, T* v_cache,            \
              const int64_t* new_slots, const int32_t* block_tables, int64_t max_blocks,     \
              int64_t block_size, const int32_t* seq_lens, int64_t B, int64_t H,             \
              int64_t Hkv, int64_t D, float scale, int64_t window, T* out) {                 \
        const int64_t row = Hkv * D, G = H / Hkv;                                            \
        for (int64_t b = 0; b < B; b++) {                                                    \
            memcpy(k_cache + new_slots[b] * row, k_new + b * row, (size_t)row * sizeof(T));  \
            memcpy(v_cache + new_slots[b] * row, v_new + b * row, (size_t)row * sizeof(T));  \
        }                                                                                    \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t item = 0; item < B * Hkv; item++) {                                     \
            const int64_t b = item / Hkv, h = item % Hkv;                                    \
            const int64_t len = seq_lens[b];                                                 \
            const int64_t first = window > 0 && len > window ? len - window : 0;             \
            const int32_t* table = block_tables + b * max_blocks;                            \
            float* qf = (float*)malloc(sizeof(float) * (size_t)(2 * G * D + G * (KEY_CHUNK + 2))); \
            float *acc = qf + G * D, *m = acc + G * D, *l = m + G, *p = l + G;               \
            for (int64_t g = 0; g < G; g++) {                                                \
                const T* qg = q + (b * H + h * G + g) * D;                                   \
                for (int64_t d = 0; d < D; d++) qf[g * D + d] = SLOAD(qg + d);               \
                for (int64_t d = 0; d < D; d++) acc[g * D + d] = 0.0f;                       \
                m[g] = -INFINITY;                                                            \
                l[g] = 0.0f;                                                                 \
            }                                                                                \
            for (int64_t j0 = first; j0 < len; j0 += KEY_CHUNK) {                            \
                const int64_t n = len - j0 < KEY_CHUNK ? len - j0 : KEY_CHUNK;               \
                const T* keys[KEY_CHUNK];                                                    \
                const T* values[KEY_CHUNK];                                                  \
                for (int64_t j = 0; j < n; j++) {                                            \
                    const int64_t pos = j0 + j;                                              \
                    const int64_t slot = (int64_t)table[pos / block_size] * block_size       \
                                         + pos % block_size;                                 \
                    keys[j] = k_cache + slot * row + h * D;                                  \
                    values[j] = v_cache + slot * row + h * D;                                \
                    /* the cache is cold after a layer's weights streamed through: ask */    \
                    /* for the next chunk's rows while this one computes (and for the */     \
                    /* first chunk's before its first dot product waits on one) */           \
                    if (j0 == first) prefetch_rows(keys[j], values[j], D * (int64_t)sizeof(T)); \
                    const int64_t ahead = pos + KEY_CHUNK;                                   \
                    if (ahead < len) {                                                       \
                        const int64_t next = (int64_t)table[ahead / block_size] * block_size \
                                             + ahead % block_size;                           \
                        prefetch_rows(k_cache + next * row + h * D, v_cache + next * row + h * D, \
                                      D * (int64_t)sizeof(T));                               \
                    }                                                                        \
                }                                                                            \
                for (int64_t g = 0; g < G; g++) {                                            \
                    float* s = p + g * KEY_CHUNK;                                            \
                    float top = m[g];                                                        \
                    for (int64_t j = 0; j < n; j++) {                                        \
                        s[j] = DOT(qf + g * D, keys[j], D) * scale;                          \
                        top = s[j] > top ? s[j] : top;                                       \
                    }                                                                        \
                    const float rescale = m[g] == -INFINITY ? 0.0f : expf(m[g] - top);       \
                    const float sum = exp_shift(s, n, top);                                  \
                    l[g] = l[g] * rescale + sum;                                             \
                    m[g] = top;                                                              \
                    float* a = acc + g * D;                                                  \
                    if (rescale != 1.0f)                                                     \
                        for (int64_t d = 0; d < D; d++) a[d] *= rescale;                     \
                    for (int64_t j = 0; j < n; j++) AXPY_T(a, s[j], values[j], D);           \
                }                                                                            \
            }                                                                                \
            for (int64_t g = 0; g < G; g++) {                                                \
                T* o = out + (b * H + h * G + g) * D;                                        \
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;                          \
                for (int64_t d = 0; d < D; d++) SSTORE(o + d, acc[g * D + d] * inv);         \
            }                                                                                \
            free(qf);                                                                        \
        }                                                                                    \
    }

DECODE_ATTENTION(foveal_decode_attention_f32, float, dot_f32, axpy_f32, load_f32, store_f32)
DECODE_ATTENTION(foveal_decode_attention_bf16, uint16_t, dot_bf16, axpy_bf16, load_bf16, store_bf16)
