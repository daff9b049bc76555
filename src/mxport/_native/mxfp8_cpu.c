/*
 * mxport native CPU kernel: rowwise MXFP8 quantization in one pass (AVX-512).
 *
 * The same algorithm as mxport.quantize._rowwise_kernel (the eager reference), byte for byte:
 *   - blocks of 32 along each row; a short last block uses its valid elements only (zero fill never changes an
 *     amax); NaN elements are skipped in the amax (the magnitude bits of a NaN exceed 0x7F800000);
 *   - shared scale E (E8M0 byte): "rceil" = the smallest E with 2^(E-127) >= f32(amax * f32(1/max_norm)),
 *     clamped to [0, 254] (TE common/util/ptx.cuh float_to_e8m0, cvt.rp.satfinite.ue8m0x2.f32); "floor" = OCP MX
 *     v1.0 section 6.3, floor(log2 amax) - emax_elem + 127 from the exponent field, clamped, Inf -> 254;
 *   - values: f32(x * 2^(127-E)) (the multiplier built from bits), then a saturating round-to-nearest-even cast to
 *     E4M3 / E5M2 computed on the float32 bits (Inf -> +-max_norm, every NaN -> the byte 0x7F).
 *
 * Sixteen blocks are handled together: their amaxes meet in one vector through a shuffle tree, their scales are
 * computed in one vector, then each block is re-read from L1 and cast. 32x32 blocks (TE with_2d_quantization) take
 * the max of those amax vectors over 32 rows. float32 rows of 1-D blocks are cast in 32-bit integer lanes instead
 * (see "float32 rows" in the AVX-512 section), with the float path above for the blocks that need it. No torch
 * headers: the Python side (mxport/native.py) compiles this file once with the system C compiler and calls it
 * through ctypes, splitting rows across threads.
 *
 * Without AVX-512 (F, BW, VL, DQ) but with AVX2 and F16C (most x86-64 CPUs since 2013, AMD Zen included) the
 * same algorithm runs eight lanes wide. bfloat16 and float32 rows of 1-D blocks take eight blocks at a time,
 * cast in 16-bit / 32-bit integer lanes (see "bfloat16 rows" and "float32 rows" below); float16 inputs, 32x32
 * blocks and the blocks those paths leave (NaN / Inf, FP8 subnormals, tiny scales) one block at a time: its
 * 32 elements loaded once as four float32 vectors, their amax reduced to one scalar, the scale computed in
 * scalar code, and the four vectors cast from registers. Built with neither, the library exports only
 * mxport_native_abi() == 0, and Python uses the torch.compile path instead. mxport_native_isa() names the
 * kernel that was built.
 */
#include <stdint.h>
#include <string.h>

#define MXPORT_NATIVE_ABI 8

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define MXPORT_HAVE_KERNEL 1
#define MXPORT_ISA "avx512"
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__)
#define MXPORT_HAVE_KERNEL 2
#define MXPORT_ISA "avx2"
#include <immintrin.h>
#else
#define MXPORT_HAVE_KERNEL 0
#define MXPORT_ISA ""
#endif

int mxport_native_abi(void) { return MXPORT_HAVE_KERNEL ? MXPORT_NATIVE_ABI : 0; }

/* The instruction set the kernel was built for: "avx512", "avx2", or "" (no kernel). */
const char *mxport_native_isa(void) { return MXPORT_ISA; }

int mxport_native_cpu_ok(void) {
#if MXPORT_HAVE_KERNEL == 1
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#elif MXPORT_HAVE_KERNEL == 2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

enum { IN_F32 = 0, IN_BF16 = 1, IN_F16 = 2 };
enum { EL_E4M3 = 0, EL_E5M2 = 1 };

#define INLINE static inline __attribute__((always_inline))

/* Tests only (a build that quantize uses fails its self-check with it): the fast paths (bfloat16 and float32 rows
 * cast in integer lanes) keep their own bytes for every block outside groups with a NaN or an Inf, with their
 * float32 fallback for small scales and FP8 subnormals compiled out, so that a test can see that the blocks the
 * fallback leaves alone get the right bytes from the fast path itself. */
#ifndef MXPORT_TEST_FAST_ONLY
#define MXPORT_TEST_FAST_ONLY 0
#endif

#if MXPORT_HAVE_KERNEL == 2
/* ---- AVX2 + F16C kernel: one block of 32 elements at a time, eight float32 lanes wide ---------------------- */

/* 32 elements (n valid, 1..32; the rest read as +0.0) as four float32 vectors. */
INLINE void load_block8(const char *p, int n, int in_dt, __m256 v[4]) {
    const int esize = in_dt == IN_F32 ? 4 : 2;
    __attribute__((aligned(32))) char tmp[128];
    if (n < 32) {  /* a short last block: copy its valid elements next to zeros */
        memset(tmp, 0, sizeof tmp);
        memcpy(tmp, p, (size_t)n * esize);
        p = tmp;
    }
    for (int i = 0; i < 4; i++) {
        if (in_dt == IN_F32) {
            v[i] = _mm256_loadu_ps((const float *)p + 8 * i);
        } else {
            __m128i raw = _mm_loadu_si128((const __m128i *)(p + 16 * i));
            v[i] = in_dt == IN_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                                    : _mm256_cvtph_ps(raw);  /* exact: every float16 is a float32 */
        }
    }
}

/* The amax of a block as float32 magnitude bits (NaN lanes skipped: their magnitude bits exceed 0x7F800000; the
 * bits are non-negative, so signed 32-bit compares and maxima order them). */
INLINE uint32_t block_amax8(const __m256 v[4]) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    __m256i m = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256i a = _mm256_and_si256(_mm256_castps_si256(v[i]), abs_mask);
        a = _mm256_andnot_si256(_mm256_cmpgt_epi32(a, inf), a);
        m = _mm256_max_epi32(m, a);
    }
    __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(h);
}

/* The E8M0 byte of a block from its amax bits (non-negative, finite or +Inf): the scalar form of scale_bytes. */
INLINE uint32_t scale_byte1(uint32_t amax_bits, int floor_r, float inv_max_norm, int emax) {
    if (floor_r) {
        int ex = (int)(amax_bits >> 23);
        if (ex == 255)
            return 254;
        int e = ex - emax;
        return (uint32_t)(e < 0 ? 0 : e > 254 ? 254 : e);
    }
    float a, v;
    uint32_t vb;
    memcpy(&a, &amax_bits, 4);
    v = a * inv_max_norm;
    memcpy(&vb, &v, 4);
    uint32_t ex = vb >> 23, mant = vb & 0x7FFFFF;
    if (mant > 0 && (ex != 0 || mant > 0x400000))
        ex += 1;
    return ex > 254 ? 254 : ex;
}

/* float32 2^(127-E) for an E8M0 byte E <= 254, built from bits. */
INLINE float multiplier1(uint32_t e) {
    uint32_t field = 254 - e, bits = field >= 1 ? field << 23 : 0x00400000u;
    float m;
    memcpy(&m, &bits, 4);
    return m;
}

/* Saturating round-to-nearest-even float32 -> FP8 codes (eight int32 lanes), NaN -> 0x7F: cast_fp8, eight wide. */
INLINE __m256i cast_fp8_8(__m256 y, int elem) {
    const int mbits = elem == EL_E4M3 ? 3 : 2, bias = elem == EL_E4M3 ? 7 : 15, shift = 23 - mbits;
    const float max_norm = elem == EL_E4M3 ? 448.0f : 57344.0f;
    const float min_normal = elem == EL_E4M3 ? 0.015625f : 6.103515625e-05f;  /* 2^(1-bias) */
    const float sub_scale = elem == EL_E4M3 ? 512.0f : 65536.0f;               /* 2^(bias-1+mbits) */
    __m256i ybits = _mm256_castps_si256(y);
    /* a = min(|y|, max_norm): Inf saturates; a NaN lane gives max_norm here and is replaced below */
    __m256 a = _mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(ybits, _mm256_set1_epi32(0x7FFFFFFF))),
                             _mm256_set1_ps(max_norm));
    __m256i bits = _mm256_castps_si256(a);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, shift), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(
        _mm256_add_epi32(bits, _mm256_set1_epi32((1 << (shift - 1)) - 1 - ((127 - bias) << (mbits + shift)))), lsb);
    __m256i mag = _mm256_max_epi32(_mm256_srai_epi32(rounded, shift), _mm256_setzero_si256());
    __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(min_normal), _CMP_LT_OQ);
    if (_mm256_movemask_ps(is_sub)) {
        __m256 s = _mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(sub_scale)), _mm256_set1_ps(8388608.0f));
        __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(s), _mm256_set1_epi32(0x4B000000));
        mag = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(sub), is_sub));
    }
    __m256i q = _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(ybits, 24), _mm256_set1_epi32(0x80)));
    __m256 nan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(q), _mm256_castsi256_ps(_mm256_set1_epi32(0x7F)),
                                                nan));
}

/* Cast a loaded block with multiplier m and store its n bytes. */
INLINE void cast_block8(const __m256 v[4], uint8_t *out, int n, float m, int elem) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256i c[4];
    for (int i = 0; i < 4; i++)
        c[i] = cast_fp8_8(_mm256_mul_ps(v[i], mv), elem);
    /* codes are 0..255: the two saturating packs are exact; they interleave 128-bit lanes, undone by the permute */
    __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (n == 32) {
        _mm256_storeu_si256((__m256i *)out, p);
    } else {
        __attribute__((aligned(32))) uint8_t tmp[32];
        _mm256_store_si256((__m256i *)tmp, p);
        memcpy(out, tmp, (size_t)n);
    }
}

/* ---- bfloat16 rows: eight blocks at a time in 16-bit lanes -------------------------------------------------
 * For a bfloat16 x, f32(x * 2^(127-E)) is x's pattern with 127 - E added to its exponent field whenever x and the
 * product are normal numbers (exact, as the float32 product is), and the FP8 rounding of its 7 mantissa bits is
 * the float32 rounding above (the 16 low bits of the float32 pattern are zero, so "add half - 1 + lsb, shift"
 * gives the same code). So the cast runs sixteen elements per vector, in integer ops only; the sign bytes come
 * from the raw inputs with one saturating pack. Eight blocks share one shuffle-tree amax and one vector of scales,
 * worked out a group ahead of their cast. Products at or below half the least FP8 subnormal have code 0 (their
 * "add, arithmetic shift" is negative and the unsigned pack saturates it to 0). What this does not cover takes the
 * float32 path above, byte for byte the same: every block of a group holding a NaN or an Inf, a block whose scale
 * E <= bias + mbits (a zero or subnormal input could then look normal), and a block with a product in
 * (min_subnormal / 2, min_normal): a nonzero FP8 subnormal code. */

/* Eight vectors of sixteen 16-bit magnitudes -> 32-bit lane j = the max over vector j's lanes. */
INLINE __m256i reduce_max8_u16(const __m256i m[8]) {
    __m256i l1[4], l2[2];
    for (int i = 0; i < 4; i++)  /* per 128-bit lane, dwords from vectors 2i, 2i+1, 2i, 2i+1 */
        l1[i] = _mm256_max_epu16(_mm256_unpacklo_epi32(m[2 * i], m[2 * i + 1]),
                                 _mm256_unpackhi_epi32(m[2 * i], m[2 * i + 1]));
    for (int i = 0; i < 2; i++)  /* per 128-bit lane, dwords from vectors 4i .. 4i+3 */
        l2[i] = _mm256_max_epu16(_mm256_unpacklo_epi64(l1[2 * i], l1[2 * i + 1]),
                                 _mm256_unpackhi_epi64(l1[2 * i], l1[2 * i + 1]));
    __m256i r = _mm256_max_epu16(_mm256_permute2x128_si256(l2[0], l2[1], 0x20),
                                 _mm256_permute2x128_si256(l2[0], l2[1], 0x31));
    return _mm256_and_si256(_mm256_max_epu16(r, _mm256_srli_epi32(r, 16)), _mm256_set1_epi32(0xFFFF));
}

/* E8M0 bytes (int32 lanes) from amax bits (non-negative, finite or +Inf): scale_byte1, eight wide. */
INLINE __m256i scale_bytes8(__m256i amax_bits, int floor_r, float inv_max_norm, int emax) {
    const __m256i zero = _mm256_setzero_si256(), e254 = _mm256_set1_epi32(254);
    if (floor_r) {
        __m256i ex = _mm256_srli_epi32(amax_bits, 23);
        __m256i e = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(ex, _mm256_set1_epi32(emax)), zero), e254);
        return _mm256_blendv_epi8(e, e254, _mm256_cmpeq_epi32(ex, _mm256_set1_epi32(255)));
    }
    __m256i vb = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(amax_bits), _mm256_set1_ps(inv_max_norm)));
    __m256i ex = _mm256_srli_epi32(vb, 23), mant = _mm256_and_si256(vb, _mm256_set1_epi32(0x7FFFFF));
    __m256i up = _mm256_and_si256(_mm256_cmpgt_epi32(mant, zero),
                                  _mm256_or_si256(_mm256_cmpgt_epi32(ex, zero),
                                                  _mm256_cmpgt_epi32(mant, _mm256_set1_epi32(0x400000))));
    return _mm256_min_epi32(_mm256_sub_epi32(ex, up), e254);  /* up is -1 where E rounds up */
}

/* The float32 path for the full blocks the bfloat16 / float32 paths leave (out of line: kept out of the hot
 * loop's registers). */
__attribute__((noinline, cold)) static void cast_block_f32(const char *p, uint8_t *out, uint32_t eb,
                                                           int in_dt, int elem) {
    __m256 v[4];
    load_block8(p, 32, in_dt, v);
    if (elem == EL_E4M3)
        cast_block8(v, out, 32, multiplier1(eb), EL_E4M3);
    else
        cast_block8(v, out, 32, multiplier1(eb), EL_E5M2);
}

/* One block the float32 way, scale included (n valid elements). */
INLINE void quantize_block_f32(const char *p, uint8_t *out, uint8_t *e, int n, int in_dt, int elem, int floor_r,
                               float inv_max_norm, int emax) {
    __m256 v[4];
    load_block8(p, n, in_dt, v);
    uint32_t eb = scale_byte1(block_amax8(v), floor_r, inv_max_norm, emax);
    *e = (uint8_t)eb;
    cast_block8(v, out, n, multiplier1(eb), elem);
}

/* Constants of the bfloat16 path, hidden from the compiler once made (else GCC rebuilds them in every block, and
 * turns "u > lo" into "min(u, lo + 1) == lo + 1"). */
#define OPAQUE(v) __asm__("" : "+x"(v))
struct bf16_consts {
    __m256i mag_mask, low_shift, low_top, one, max_code, sign;
    int saturate; /* 0: no product can exceed max_norm (see quantize_bf16_row) */
};

INLINE struct bf16_consts bf16_consts_for(int elem, int saturate) {
    const int mbits = elem == EL_E4M3 ? 3 : 2, shift = 7 - mbits, half = (1 << (shift - 1)) - 1;
    struct bf16_consts k = {
        _mm256_set1_epi16(0x7FFF), _mm256_set1_epi16((short)(mbits * 128 - half - 1)),
        _mm256_set1_epi16((short)((mbits + 1) * 128 - 2)), _mm256_set1_epi16(1),
        _mm256_set1_epi16(elem == EL_E4M3 ? 0x7E : 0x7B), _mm256_set1_epi8((char)0x80), saturate};
    OPAQUE(k.mag_mask);
    OPAQUE(k.low_shift);
    OPAQUE(k.low_top);
    OPAQUE(k.one);
    OPAQUE(k.max_code);
    OPAQUE(k.sign);
    return k;
}

/* FP8 codes of sixteen bfloat16 magnitudes mag given c = (bias - E) << 7 + half - 1 (16-bit lanes). *low: u moved
 * so that the products in (min_subnormal / 2, min_normal), u in (half - mbits * 128, half + 128), are the unsigned
 * values 0 .. low_top (the caller looks for one). */
INLINE __m256i bf16_codes(__m256i mag, __m256i c, int elem, const struct bf16_consts *k, __m256i *low) {
    const int shift = elem == EL_E4M3 ? 4 : 5;
    __m256i u = _mm256_add_epi16(mag, c);  /* (product pattern) - ((127 - bias) << 7) + half - 1 */
    *low = _mm256_add_epi16(u, k->low_shift);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(mag, shift), k->one);
    __m256i q = _mm256_srai_epi16(_mm256_add_epi16(u, lsb), shift);
    return k->saturate ? _mm256_min_epi16(q, k->max_code) : q;
}

/* The amaxes of g (1..8) full bfloat16 blocks at xr as magnitude bits, one per 32-bit lane (0 past g). */
INLINE __m256i bf16_group_amax(const uint16_t *xr, int g) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7FFF);
    __m256i m[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i *p = (const __m256i *)(xr + 32 * j);
        m[j] = j < g ? _mm256_max_epu16(_mm256_and_si256(_mm256_loadu_si256(p), mag_mask),
                                        _mm256_and_si256(_mm256_loadu_si256(p + 1), mag_mask))
                     : _mm256_setzero_si256();
    }
    return reduce_max8_u16(m);
}

/* Store the low bytes of the first g (1..8) 32-bit lanes of e at er. */
INLINE void store_bytes8(uint8_t *er, __m256i e, int g) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(e, e), e);  /* lane L: bytes 0-3 = lanes 4L .. 4L+3 */
    __m128i v = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (g == 8) {
        _mm_storel_epi64((__m128i *)er, v);
    } else {
        __attribute__((aligned(16))) uint8_t tmp[16];
        _mm_store_si128((__m128i *)tmp, v);
        memcpy(er, tmp, (size_t)g);
    }
}

/* A group's scales, worked out a group ahead of its cast (the amax -> scale chain is long; the cast of the group
 * before runs meanwhile): e (E8M0 bytes, 32-bit lanes), or special when the group holds a NaN or an Inf. */
struct group_plan {
    __m256i e;
    int special;
};

INLINE struct group_plan bf16_group_plan(const uint16_t *xr, int g, int floor_r, float inv_max_norm,
                                         int emax) {
    __m256i amax = bf16_group_amax(xr, g);
    struct group_plan plan = {scale_bytes8(_mm256_slli_epi32(amax, 16), floor_r, inv_max_norm, emax),
                             _mm256_movemask_epi8(_mm256_cmpgt_epi32(amax, _mm256_set1_epi32(0x7F7F)))};
    return plan;
}

/* Cast one full block (c: its (bias - E) << 7 + half - 1 in every 16-bit lane) and store its 32 bytes; fold its
 * subnormal-check lanes into *low (unsigned min: a lane <= low_top marks a nonzero FP8 subnormal). */
INLINE void bf16_block(const uint16_t *p, uint8_t *out, __m256i c, int elem, const struct bf16_consts *k,
                       __m256i *low) {
    __m256i r0 = _mm256_loadu_si256((const __m256i *)p), r1 = _mm256_loadu_si256((const __m256i *)(p + 16));
    __m256i low0, low1;
    __m256i q0 = bf16_codes(_mm256_and_si256(r0, k->mag_mask), c, elem, k, &low0);
    __m256i q1 = bf16_codes(_mm256_and_si256(r1, k->mag_mask), c, elem, k, &low1);
    *low = _mm256_min_epu16(*low, _mm256_min_epu16(low0, low1));
    __m256i sign = _mm256_and_si256(_mm256_packs_epi16(r0, r1), k->sign);
    __m256i q = _mm256_or_si256(_mm256_packus_epi16(q0, q1), sign);  /* qwords: 0-7, 16-23, 8-15, 24-31 */
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(q, _MM_SHUFFLE(3, 1, 2, 0)));
}

INLINE int bf16_has_subnormal(__m256i low, const struct bf16_consts *k) {
    __m256i sub = _mm256_cmpeq_epi16(_mm256_subs_epu16(low, k->low_top), _mm256_setzero_si256());
    return !_mm256_testz_si256(sub, sub);
}

/* The c vector of a group (one 32-bit lane per block, the 16-bit value twice) -> block j's c in every lane. */
INLINE __m256i bf16_block_c(__m256i c, int j) {
    c = j < 4 ? _mm256_permute2x128_si256(c, c, 0x00) : _mm256_permute2x128_si256(c, c, 0x11);
    return (j & 3) == 0 ? _mm256_shuffle_epi32(c, 0x00) : (j & 3) == 1 ? _mm256_shuffle_epi32(c, 0x55)
         : (j & 3) == 2 ? _mm256_shuffle_epi32(c, 0xAA) : _mm256_shuffle_epi32(c, 0xFF);
}

/* The blocks of a group that the 16-bit lanes do not cover (a scale E <= bias + mbits, or a nonzero FP8 subnormal
 * product), found again and cast over the float32 way (rare: out of line). */
__attribute__((noinline, cold)) static void bf16_group_redo(const uint16_t *xr, uint8_t *qr, int g, __m256i e,
                                                             __m256i c, int elem) {
    const int bias = elem == EL_E4M3 ? 7 : 15, mbits = elem == EL_E4M3 ? 3 : 2;
    const struct bf16_consts k = bf16_consts_for(elem, 1);
    __attribute__((aligned(32))) uint32_t eb[8];
    __attribute__((aligned(32))) uint8_t scratch[32];
    _mm256_store_si256((__m256i *)eb, e);
    for (int j = 0; j < g; j++) {
        __m256i low = _mm256_set1_epi16(-1);
        bf16_block(xr + 32 * j, scratch, _mm256_permutevar8x32_epi32(c, _mm256_set1_epi32(j)), elem, &k, &low);
        if ((int)eb[j] <= bias + mbits || bf16_has_subnormal(low, &k))
            cast_block_f32((const char *)(xr + 32 * j), qr + 32 * j, eb[j], IN_BF16, elem);
    }
}

/* g (1..8) full blocks of a bfloat16 row from xr into qr (FP8 bytes) and er (E8M0 bytes), with their plan. */
INLINE void quantize_bf16_group(const uint16_t *xr, uint8_t *qr, uint8_t *er, int g, struct group_plan plan,
                                int elem, int floor_r, float inv_max_norm, int emax, int saturate) {
    const int bias = elem == EL_E4M3 ? 7 : 15, mbits = elem == EL_E4M3 ? 3 : 2, half = (1 << (6 - mbits)) - 1;
    if (plan.special) {
        for (int j = 0; j < g; j++)
            quantize_block_f32((const char *)(xr + 32 * j), qr + 32 * j, er + j, 32, IN_BF16, elem, floor_r,
                               inv_max_norm, emax);
        return;
    }
    const __m256i e = plan.e;
    store_bytes8(er, e, g);
    const int bad = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(bias + mbits + 1),
                                                                              e)));
    __m256i c = _mm256_sub_epi32(_mm256_set1_epi32((bias << 7) + half), _mm256_slli_epi32(e, 7));
    c = _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(c, 16));
    const struct bf16_consts k = bf16_consts_for(elem, saturate);
    __m256i low = _mm256_set1_epi16(-1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        if (j >= g)
            break;
        bf16_block(xr + 32 * j, qr + 32 * j, bf16_block_c(c, j), elem, &k, &low);
    }
    if (!MXPORT_TEST_FAST_ONLY && (bad & ((1 << g) - 1) || bf16_has_subnormal(low, &k)))
        bf16_group_redo(xr, qr, g, e, c, elem);
}

/* ---- float32 rows: eight blocks at a time in 32-bit lanes -------------------------------------------------
 * For a float32 x and a scale E with bias + mbits < E <= 254, the cast of f32(x * 2^(127-E)) above is
 * computed on x's own bits. (1) x and the product normal: the product's pattern is x's with 127 - E added to
 * its exponent field (the float32 product is exact; the mantissa is x's), so cast_fp8_8's integer rounding of
 * the product bits (subtract (127 - bias) << 23, add half - 1 + lsb, arithmetic shift by 23 - mbits: RNE,
 * ties to even through lsb, a round-up carrying into the exponent field) is one add of c = ((bias - E) << 23)
 * + half - 1 to x's magnitude bits, then the same "+ lsb, shift". (2) x zero or float32-subnormal (x <
 * 2^-126), or a product below 2^-126: the product is below 2^(1-E) or 2^-126, both <= 2^(-bias-mbits) =
 * min_subnormal / 2, code 0 in the float path; the sum mag + ((127 - E) << 23) is below the pattern of the
 * same bound (or negative), so the shift gives a code <= 0, packed to 0. (3) Saturation: bias - E < 0, so no
 * sum overflows 32 bits; a product above max_norm (Inf included) gives a code above the largest one, and a
 * clamp min(|y|, max_norm) before a monotone rounding is a clamp of the code after it. Signs come from x (a
 * float32 product keeps its sign, zero included) through two signed saturating packs. The rest takes the
 * float32 path, byte for byte: every block of a group holding a NaN or an Inf, a block with E <= bias +
 * mbits, and a block with a product in (min_subnormal / 2, min_normal) (a nonzero FP8 subnormal, rounded at a
 * position that depends on its exponent). As for bfloat16, the scales come a group ahead of the cast. */

struct f32_consts {
    __m256i mag_mask, one, low_shift, low_top, max_code, sign, pack_order;
    int saturate; /* 0: no product can exceed max_norm (see quantize_fast_row) */
};

INLINE struct f32_consts f32_consts_for(int elem, int saturate) {
    const int mbits = elem == EL_E4M3 ? 3 : 2, half = 1 << (22 - mbits);
    struct f32_consts k = {
        _mm256_set1_epi32(0x7FFFFFFF), _mm256_set1_epi32(1), _mm256_set1_epi32((mbits << 23) - half),
        _mm256_set1_epi32(((mbits + 1) << 23) - 2), _mm256_set1_epi32(elem == EL_E4M3 ? 0x7E : 0x7B),
        _mm256_set1_epi8((char)0x80), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), saturate};
    OPAQUE(k.mag_mask);
    OPAQUE(k.one);
    OPAQUE(k.low_shift);
    OPAQUE(k.low_top);
    OPAQUE(k.max_code);
    OPAQUE(k.sign);
    OPAQUE(k.pack_order);
    return k;
}

/* FP8 codes (int32 lanes, <= 0 for code 0) of eight float32 magnitudes mag given c = ((bias - E) << 23) +
 * half - 1. *low: u moved so that the products in (min_subnormal / 2, min_normal), u in (half - 1 - (mbits <<
 * 23), half - 1 + (1 << 23)), are the unsigned values 0 .. low_top (the caller looks for one). */
INLINE __m256i f32_codes(__m256i mag, __m256i c, int elem, const struct f32_consts *k, __m256i *low) {
    const int shift = elem == EL_E4M3 ? 20 : 21;
    __m256i u = _mm256_add_epi32(mag, c);  /* (product pattern) - ((127 - bias) << 23) + half - 1 */
    *low = _mm256_add_epi32(u, k->low_shift);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mag, shift), k->one);
    __m256i q = _mm256_srai_epi32(_mm256_add_epi32(u, lsb), shift);
    return k->saturate ? _mm256_min_epi32(q, k->max_code) : q;
}

/* Cast one full float32 block (c: its ((bias - E) << 23) + half - 1 in every lane) and store its 32 bytes;
 * fold its subnormal-check lanes into *low (unsigned min: a lane <= low_top marks a nonzero FP8 subnormal).
 */
INLINE void f32_block(const float *p, uint8_t *out, __m256i c, int elem, const struct f32_consts *k,
                      __m256i *low) {
    __m256i r[4], q[4], l[4];
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_loadu_si256((const __m256i *)(p + 8 * i));
        q[i] = f32_codes(_mm256_and_si256(r[i], k->mag_mask), c, elem, k, &l[i]);
    }
    __m256i l4 = _mm256_min_epu32(_mm256_min_epu32(l[0], l[1]), _mm256_min_epu32(l[2], l[3]));
    *low = _mm256_min_epu32(*low, l4);
    /* codes <= 0 pack to 0, the others are 1..0x7E: the packs are exact; the signed packs keep each sign bit
     */
    __m256i v = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
    __m256i sign = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    v = _mm256_or_si256(v, _mm256_and_si256(sign, k->sign));  /* dwords: 0-3, 8-11, 16-19, 24-27, 4-7, ... */
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(v, k->pack_order));
}

INLINE int f32_has_subnormal(__m256i low, const struct f32_consts *k) {
    __m256i sub = _mm256_cmpeq_epi32(_mm256_max_epu32(low, k->low_top), k->low_top);
    return !_mm256_testz_si256(sub, sub);
}

/* Eight vectors of eight int32 lanes -> lane j = the max over vector j's lanes. */
INLINE __m256i reduce_max8_i32(const __m256i m[8]) {
    __m256i l1[4], l2[2];
    for (int i = 0; i < 4; i++)  /* per 128-bit lane, dwords from vectors 2i, 2i+1, 2i, 2i+1 */
        l1[i] = _mm256_max_epi32(_mm256_unpacklo_epi32(m[2 * i], m[2 * i + 1]),
                                 _mm256_unpackhi_epi32(m[2 * i], m[2 * i + 1]));
    for (int i = 0; i < 2; i++)  /* per 128-bit lane, dwords from vectors 4i .. 4i+3 */
        l2[i] = _mm256_max_epi32(_mm256_unpacklo_epi64(l1[2 * i], l1[2 * i + 1]),
                                 _mm256_unpackhi_epi64(l1[2 * i], l1[2 * i + 1]));
    return _mm256_max_epi32(_mm256_permute2x128_si256(l2[0], l2[1], 0x20),
                            _mm256_permute2x128_si256(l2[0], l2[1], 0x31));
}

/* The amaxes of g (1..8) full float32 blocks at xr as magnitude bits (NaN: above 0x7F800000), one per lane (0
 * past g). */
INLINE __m256i f32_group_amax(const float *xr, int g) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i *p = (const __m256i *)(xr + 32 * j);
        m[j] = _mm256_setzero_si256();
        if (j < g)
            for (int i = 0; i < 4; i++)
                m[j] = _mm256_max_epi32(m[j], _mm256_and_si256(_mm256_loadu_si256(p + i), mag_mask));
    }
    return reduce_max8_i32(m);
}

INLINE struct group_plan f32_group_plan(const float *xr, int g, int floor_r, float inv_max_norm, int emax) {
    __m256i amax = f32_group_amax(xr, g);
    struct group_plan plan = {scale_bytes8(amax, floor_r, inv_max_norm, emax),
                              _mm256_movemask_epi8(_mm256_cmpgt_epi32(amax, _mm256_set1_epi32(0x7F7FFFFF)))};
    return plan;
}

/* The blocks of a group that the 32-bit lanes do not cover (a scale E <= bias + mbits, or a nonzero FP8
 * subnormal product), found again and cast over the float32 way (rare: out of line). */
__attribute__((noinline, cold)) static void f32_group_redo(const float *xr, uint8_t *qr, int g, __m256i e,
                                                            __m256i c, int elem) {
    const int bias = elem == EL_E4M3 ? 7 : 15, mbits = elem == EL_E4M3 ? 3 : 2;
    const struct f32_consts k = f32_consts_for(elem, 1);
    __attribute__((aligned(32))) uint32_t eb[8];
    __attribute__((aligned(32))) uint8_t scratch[32];
    _mm256_store_si256((__m256i *)eb, e);
    for (int j = 0; j < g; j++) {
        __m256i low = _mm256_set1_epi32(-1);
        f32_block(xr + 32 * j, scratch, _mm256_permutevar8x32_epi32(c, _mm256_set1_epi32(j)), elem, &k, &low);
        if ((int)eb[j] <= bias + mbits || f32_has_subnormal(low, &k))
            cast_block_f32((const char *)(xr + 32 * j), qr + 32 * j, eb[j], IN_F32, elem);
    }
}

/* g (1..8) full blocks of a float32 row from xr into qr (FP8 bytes) and er (E8M0 bytes), with their plan. */
INLINE void quantize_f32_group(const float *xr, uint8_t *qr, uint8_t *er, int g, struct group_plan plan,
                               int elem, int floor_r, float inv_max_norm, int emax, int saturate) {
    const int bias = elem == EL_E4M3 ? 7 : 15, mbits = elem == EL_E4M3 ? 3 : 2, half = 1 << (22 - mbits);
    if (plan.special) {
        for (int j = 0; j < g; j++)
            quantize_block_f32((const char *)(xr + 32 * j), qr + 32 * j, er + j, 32, IN_F32, elem, floor_r,
                               inv_max_norm, emax);
        return;
    }
    const __m256i e = plan.e;
    store_bytes8(er, e, g);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(bias + mbits + 1), e);
    const int bad = _mm256_movemask_ps(_mm256_castsi256_ps(small));
    /* E <= 254: E << 23 fits in int32 */
    const __m256i c = _mm256_sub_epi32(_mm256_set1_epi32((bias << 23) + half - 1), _mm256_slli_epi32(e, 23));
    const struct f32_consts k = f32_consts_for(elem, saturate);
    __m256i low = _mm256_set1_epi32(-1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        if (j >= g)
            break;
        f32_block(xr + 32 * j, qr + 32 * j, _mm256_permutevar8x32_epi32(c, _mm256_set1_epi32(j)), elem, &k,
                  &low);
    }
    if (!MXPORT_TEST_FAST_ONLY && (bad & ((1 << g) - 1) || f32_has_subnormal(low, &k)))
        f32_group_redo(xr, qr, g, e, c, elem);
}

/* ---- the rows of the two fast paths (in_dt IN_BF16 or IN_F32, a constant once inlined) ----------------- */

INLINE struct group_plan group_plan(const char *xr, int g, int in_dt, int floor_r, float inv_max_norm,
                                    int emax) {
    return in_dt == IN_F32 ? f32_group_plan((const float *)xr, g, floor_r, inv_max_norm, emax)
                           : bf16_group_plan((const uint16_t *)xr, g, floor_r, inv_max_norm, emax);
}

INLINE void quantize_group(const char *xr, uint8_t *qr, uint8_t *er, int g, struct group_plan plan, int in_dt,
                           int elem, int floor_r, float inv_max_norm, int emax, int saturate) {
    if (in_dt == IN_F32)
        quantize_f32_group((const float *)xr, qr, er, g, plan, elem, floor_r, inv_max_norm, emax, saturate);
    else
        quantize_bf16_group((const uint16_t *)xr, qr, er, g, plan, elem, floor_r, inv_max_norm, emax,
                            saturate);
}

/* Prefetch, a group at a time: its input FAST_PREFETCH_BYTES ahead, its output as many groups ahead (for
 * writing). The hardware prefetcher alone leaves a single thread short of the memory bandwidth. A hint: never
 * faults, so reading past the end is harmless. */
#define FAST_PREFETCH_BYTES 4096
INLINE void group_prefetch(const char *x, const uint8_t *q, int esize) {
    for (int l = 0; l < 4 * esize; l++)
        __builtin_prefetch(x + FAST_PREFETCH_BYTES + 64 * l, 0, 3);
    for (int l = 0; l < 4; l++)
        __builtin_prefetch(q + FAST_PREFETCH_BYTES / esize + 64 * l, 1, 3);
}

/* One row of k elements: groups of eight full blocks, then the short last block; saturate: clamp the codes to
 * the largest one. */
INLINE void fast_row(const char *xr, int64_t k, uint8_t *qr, uint8_t *er, int in_dt, int elem, int floor_r,
                     float inv_max_norm, int emax, int saturate) {
    const int esize = in_dt == IN_F32 ? 4 : 2;
    const int64_t full = k / 32, groups = full / 8;
    struct group_plan plan = {_mm256_setzero_si256(), 0};
    if (groups)
        plan = group_plan(xr, 8, in_dt, floor_r, inv_max_norm, emax);
    for (int64_t i = 0; i < groups; i++) {
        const int64_t b = 8 * i;
        struct group_plan next = plan;
        group_prefetch(xr + 32 * b * esize, qr + 32 * b, esize);
        if (i + 1 < groups)
            next = group_plan(xr + 32 * (b + 8) * esize, 8, in_dt, floor_r, inv_max_norm, emax);
        quantize_group(xr + 32 * b * esize, qr + 32 * b, er + b, 8, plan, in_dt, elem, floor_r, inv_max_norm,
                       emax, saturate);
        plan = next;
    }
    if (full % 8) {
        const int64_t b = 8 * groups;
        const int g = (int)(full % 8);
        quantize_group(xr + 32 * b * esize, qr + 32 * b, er + b, g, group_plan(xr + 32 * b * esize, g, in_dt,
                       floor_r, inv_max_norm, emax), in_dt, elem, floor_r, inv_max_norm, emax, saturate);
    }
    if (k % 32)
        quantize_block_f32(xr + 32 * full * esize, qr + 32 * full, er + full, (int)(k % 32), in_dt, elem,
                           floor_r, inv_max_norm, emax);
}

/* One bfloat16 or float32 row of k elements (see fast_row). With rceil and the exact f32(1/max_norm) no
 * product of the fast paths rounds above max_norm: x * 2^(127-E) <= amax / f32(amax * inv_max_norm) <
 * max_norm * (1 + 2^-22) (E > bias + mbits: f32(amax * inv_max_norm) is normal), below the midpoint max_norm
 * * (1 + 1/28) between max_norm and the next FP8 magnitude (448 / 480, 57344 / 61440): the rounding gives at
 * most the largest code. The clamp to it is then left out (it cannot change a byte); floor rounding, or
 * another inv_max_norm, keeps it. */
INLINE void quantize_fast_row(const char *xr, int64_t k, uint8_t *qr, uint8_t *er, int in_dt, int elem,
                              int floor_r, float inv_max_norm, int emax) {
    if (floor_r || inv_max_norm != 1.0f / (elem == EL_E4M3 ? 448.0f : 57344.0f))
        fast_row(xr, k, qr, er, in_dt, elem, floor_r, inv_max_norm, emax, 1);
    else
        fast_row(xr, k, qr, er, in_dt, elem, floor_r, inv_max_norm, emax, 0);
}

/* Rows [r0, r0 + nr) share their scales (nr = 1 for 1-D blocks, up to 32 for 32x32 blocks). */
INLINE void quantize_row_group(const char *x, int64_t r0, int nr, int64_t k, uint8_t *q, uint8_t *e, int in_dt,
                               int elem, int floor_r, float inv_max_norm, int emax) {
    const int esize = in_dt == IN_F32 ? 4 : 2;
    const int64_t nb = (k + 31) / 32;
    if (nr == 1 && in_dt != IN_F16) {
        quantize_fast_row(x + r0 * k * esize, k, q + r0 * k, e + r0 * nb, in_dt, elem, floor_r, inv_max_norm,
                          emax);
        return;
    }
    __m256 v[4];
    for (int64_t b = 0; b < nb; b++) {
        const int64_t start = b * 32;
        const int n = (int)(k - start < 32 ? k - start : 32);
        if (nr == 1) {  /* one pass: the block stays in registers from amax to cast */
            const char *xr = x + r0 * k * esize;
            load_block8(xr + start * esize, n, in_dt, v);
            uint32_t eb = scale_byte1(block_amax8(v), floor_r, inv_max_norm, emax);
            e[r0 * nb + b] = (uint8_t)eb;
            cast_block8(v, q + r0 * k + start, n, multiplier1(eb), elem);
            continue;
        }
        uint32_t amax = 0;
        for (int r = 0; r < nr; r++) {
            load_block8(x + ((r0 + r) * k + start) * esize, n, in_dt, v);
            uint32_t a = block_amax8(v);
            amax = a > amax ? a : amax;
        }
        uint32_t eb = scale_byte1(amax, floor_r, inv_max_norm, emax);
        float m = multiplier1(eb);
        for (int r = 0; r < nr; r++) {
            load_block8(x + ((r0 + r) * k + start) * esize, n, in_dt, v);
            e[(r0 + r) * nb + b] = (uint8_t)eb;
            cast_block8(v, q + (r0 + r) * k + start, n, m, elem);
        }
    }
}

INLINE void quantize_rows_impl(const char *x, int64_t rows, int64_t k, uint8_t *q, uint8_t *e, int in_dt,
                               int elem, int floor_r, float inv_max_norm, int emax, int block_2d) {
    const int group = block_2d ? 32 : 1;
    if (in_dt != IN_F16 && !block_2d && k % 32 == 0) {  /* rows of whole blocks: one long row of rows * k */
        quantize_fast_row(x, rows * k, q, e, in_dt, elem, floor_r, inv_max_norm, emax);
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += group)
        quantize_row_group(x, r0, (int)(rows - r0 < group ? rows - r0 : group), k, q, e, in_dt, elem, floor_r,
                           inv_max_norm, emax);
}
#endif

#if MXPORT_HAVE_KERNEL == 1

/* Raw 16-bit elements of a block (n valid; the rest read as +0.0). */
INLINE __m512i load_raw16(const char *p, int n, int full) {
    if (full)
        return _mm512_loadu_si512((const void *)p);
    uint32_t m = n >= 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
    return _mm512_maskz_loadu_epi16((__mmask32)m, (const void *)p);
}

/* 32 elements (n valid, 1..32; the rest read as +0.0) as two float32 vectors: elements 0-15 and 16-31. */
INLINE void load_block(const char *p, int n, int full, int in_dt, __m512 *lo, __m512 *hi) {
    if (in_dt == IN_F32) {
        const float *f = (const float *)p;
        if (full) {
            *lo = _mm512_loadu_ps(f);
            *hi = _mm512_loadu_ps(f + 16);
        } else {
            uint32_t m = n >= 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
            *lo = _mm512_maskz_loadu_ps((__mmask16)(m & 0xFFFF), f);
            *hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), f + 16);
        }
        return;
    }
    __m512i raw = load_raw16(p, n, full);
    __m256i r0 = _mm512_castsi512_si256(raw);
    __m256i r1 = _mm512_extracti64x4_epi64(raw, 1);
    if (in_dt == IN_BF16) {
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r0), 16));
        *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r1), 16));
    } else {
        *lo = _mm512_cvtph_ps(r0);  /* exact: every float16 is a float32 */
        *hi = _mm512_cvtph_ps(r1);
    }
}

/* Magnitude bits of a block for the amax: an unsigned max over them is the amax. With skip_nan, NaN lanes (above
 * the Inf pattern) are zeroed so that they do not take part; without, a NaN shows up as an amax above Inf (the
 * caller then redoes the group with skip_nan). 16-bit inputs stay 16-bit: 32 lanes, Inf 0x7F80 (bfloat16) or
 * 0x7C00 (float16). */
INLINE __m512i magnitude32(__m512 v, int skip_nan) {
    __m512i m = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
    if (!skip_nan)
        return m;
    return _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(m, _mm512_set1_epi32(0x7F800000)), m);
}

INLINE __m512i magnitude16(__m512i raw, int in_dt, int skip_nan) {
    __m512i m = _mm512_and_si512(raw, _mm512_set1_epi16(0x7FFF));
    if (!skip_nan)
        return m;
    const short inf = in_dt == IN_BF16 ? 0x7F80 : 0x7C00;
    return _mm512_maskz_mov_epi16(_mm512_cmple_epu16_mask(m, _mm512_set1_epi16(inf)), m);
}

/* Sixteen vectors -> one vector whose 32-bit lane j is the max over vector j: of its unsigned 32-bit lanes, or
 * (u16) of its unsigned 16-bit lanes. The shuffles move whole dwords, so 16-bit pairs travel together and are
 * folded at the end. */
INLINE __m512i reduce_max16(const __m512i *m, int u16) {
#define VMAX(a, b) (u16 ? _mm512_max_epu16((a), (b)) : _mm512_max_epu32((a), (b)))
    __m512i l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) {  /* lanes 0-7: vector 2i (8 partials), 8-15: vector 2i+1 */
        __m512i x = _mm512_shuffle_i32x4(m[2 * i], m[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i y = _mm512_shuffle_i32x4(m[2 * i], m[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
        l1[i] = VMAX(x, y);
    }
    for (int i = 0; i < 4; i++) {  /* 128-bit lane L: vector 4i+L, 4 partials */
        __m512i x = _mm512_shuffle_i32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i y = _mm512_shuffle_i32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
        l2[i] = VMAX(x, y);
    }
    for (int i = 0; i < 2; i++) {  /* lane L: [vector 8i+L] x2 partials, [vector 8i+4+L] x2 partials */
        __m512i x = _mm512_unpacklo_epi64(l2[2 * i], l2[2 * i + 1]);
        __m512i y = _mm512_unpackhi_epi64(l2[2 * i], l2[2 * i + 1]);
        l3[i] = VMAX(x, y);
    }
    /* lane L, dword d: vector 4d + L */
    __m512 h = _mm512_castsi512_ps(l3[0]), g = _mm512_castsi512_ps(l3[1]);
    __m512i x = _mm512_castps_si512(_mm512_shuffle_ps(h, g, _MM_SHUFFLE(2, 0, 2, 0)));
    __m512i y = _mm512_castps_si512(_mm512_shuffle_ps(h, g, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512i r = VMAX(x, y);
#undef VMAX
    if (u16)  /* each dword holds two 16-bit partials of one vector */
        r = _mm512_and_si512(_mm512_max_epu16(r, _mm512_srli_epi32(r, 16)), _mm512_set1_epi32(0xFFFF));
    /* position 4L + d holds vector 4d + L: gather vector p from position 4(p % 4) + p / 4 */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(idx, r);
}

/* E8M0 bytes (int32 lanes) from amax bits (non-negative, finite or +Inf). */
INLINE __m512i scale_bytes(__m512i amax_bits, int floor_r, float inv_max_norm, int emax) {
    const __m512i zero = _mm512_setzero_si512(), e254 = _mm512_set1_epi32(254);
    if (floor_r) {
        __m512i ex = _mm512_srli_epi32(amax_bits, 23); /* sign is 0 */
        __m512i e = _mm512_max_epi32(_mm512_sub_epi32(ex, _mm512_set1_epi32(emax)), zero);
        e = _mm512_min_epi32(e, e254);
        __mmask16 inf = _mm512_cmpeq_epi32_mask(ex, _mm512_set1_epi32(255));
        return _mm512_mask_blend_epi32(inf, e, e254);
    }
    __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(amax_bits), _mm512_set1_ps(inv_max_norm));
    __m512i vb = _mm512_castps_si512(v);
    __m512i ex = _mm512_srli_epi32(vb, 23);
    __m512i mant = _mm512_and_si512(vb, _mm512_set1_epi32(0x7FFFFF));
    __mmask16 up = _mm512_cmpgt_epi32_mask(mant, zero) &
                   (_mm512_cmpneq_epi32_mask(ex, zero) | _mm512_cmpgt_epi32_mask(mant, _mm512_set1_epi32(0x400000)));
    __m512i e = _mm512_mask_add_epi32(ex, up, ex, _mm512_set1_epi32(1));
    return _mm512_min_epi32(e, e254);
}

/* float32 2^(127-E) from the E8M0 bytes (E <= 254). */
INLINE __m512 multipliers(__m512i e) {
    __m512i field = _mm512_sub_epi32(_mm512_set1_epi32(254), e);
    __mmask16 normal = _mm512_cmpge_epi32_mask(field, _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(normal, _mm512_set1_epi32(0x00400000),
                                                       _mm512_slli_epi32(field, 23)));
}

/* Saturating round-to-nearest-even float32 -> FP8 bytes (16 lanes), NaN -> 0x7F (only looked for when check_nan:
 * y is NaN exactly where the input was, and the caller knows whether its group had any). */
INLINE __m128i cast_fp8(__m512 y, int elem, int check_nan) {
    const int mbits = elem == EL_E4M3 ? 3 : 2, bias = elem == EL_E4M3 ? 7 : 15, shift = 23 - mbits;
    const float max_norm = elem == EL_E4M3 ? 448.0f : 57344.0f;
    const float min_normal = elem == EL_E4M3 ? 0.015625f : 6.103515625e-05f;  /* 2^(1-bias) */
    const float sub_scale = elem == EL_E4M3 ? 512.0f : 65536.0f;               /* 2^(bias-1+mbits) */
    /* a = min(|y|, max_norm), sign cleared (VRANGEPS: min of absolute values) */
    __m512 a = _mm512_range_ps(y, _mm512_set1_ps(max_norm), 0x0A);
    __m512i bits = _mm512_castps_si512(a);
    /* normal results: round the mantissa to mbits, nearest-even (a carry into the exponent is right), and rebias
     * 127 -> bias in the same add; below the normal range (zero included) the arithmetic shift goes negative and
     * clamps to 0 */
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, shift), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(
        _mm512_add_epi32(bits, _mm512_set1_epi32((1 << (shift - 1)) - 1 - ((127 - bias) << (mbits + shift)))), lsb);
    __m512i mag = _mm512_max_epi32(_mm512_srai_epi32(rounded, shift), _mm512_setzero_si512());
    /* subnormal results (a < 2^(1-bias)): nearest-even integer of a * sub_scale, read from the mantissa of
     * a * sub_scale + 2^23 (a * sub_scale is exact, so this rounds once) */
    __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(min_normal), _CMP_LT_OQ);
    if (is_sub) {
        __m512 s = _mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(sub_scale)), _mm512_set1_ps(8388608.0f));
        __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(s), _mm512_set1_epi32(0x4B000000));
        mag = _mm512_mask_blend_epi32(is_sub, mag, sub);
    }
    /* q = mag | (sign of y >> 24 & 0x80) */
    __m512i q = _mm512_ternarylogic_epi32(mag, _mm512_srli_epi32(_mm512_castps_si512(y), 24),
                                          _mm512_set1_epi32(0x80), 0xF8);
    if (check_nan)
        q = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), q, _mm512_set1_epi32(0x7F));
    return _mm512_cvtepi32_epi8(q);
}

/* Cast one block (32 elements, n valid) with multiplier m and store its bytes. */
INLINE void cast_block(const char *p, uint8_t *out, int n, int full, int in_dt, __m512 m, int elem, int check_nan) {
    __m512 lo, hi;
    load_block(p, n, full, in_dt, &lo, &hi);
    __m128i q0 = cast_fp8(_mm512_mul_ps(lo, m), elem, check_nan);
    __m128i q1 = cast_fp8(_mm512_mul_ps(hi, m), elem, check_nan);
    __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
    if (n == 32)
        _mm256_storeu_si256((__m256i *)out, q);
    else
        _mm256_mask_storeu_epi8(out, (__mmask32)((1u << n) - 1u), q);
}

/* The amaxes of one row's group of g (1..16) blocks starting at block b0 (a row of k elements), one per 32-bit lane,
 * as magnitude bits of the input dtype (16-bit for 16-bit inputs: comparable as unsigned, NaN skipped); *nan is
 * set when the group holds a NaN. */
INLINE __m512i group_amax(const char *xr, int64_t k, int64_t b0, int g, int full, int in_dt, int *nan) {
    const int esize = in_dt == IN_F32 ? 4 : 2;
    const int u16 = in_dt != IN_F32;
    __m512i mags[16];
    __m512i amax = _mm512_setzero_si512();
    for (int pass = 0; pass < 2; pass++) {  /* pass 1 (skip_nan) only when pass 0 met a NaN */
        for (int j = 0; j < 16; j++) {
            if (!full && j >= g) {
                mags[j] = _mm512_setzero_si512();
                continue;
            }
            int64_t start = (b0 + j) * 32;
            int n = full ? 32 : (int)(k - start < 32 ? k - start : 32);
            if (u16) {
                mags[j] = magnitude16(load_raw16(xr + start * esize, n, full), in_dt, pass);
            } else {
                __m512 lo, hi;
                load_block(xr + start * esize, n, full, in_dt, &lo, &hi);
                mags[j] = _mm512_max_epu32(magnitude32(lo, pass), magnitude32(hi, pass));
            }
        }
        amax = reduce_max16(mags, u16);
        if (pass == 1)
            break;
        const int inf = in_dt == IN_F32 ? 0x7F800000 : in_dt == IN_BF16 ? 0x7F80 : 0x7C00;
        if (_mm512_cmpgt_epu32_mask(amax, _mm512_set1_epi32(inf)) == 0)
            break;
        *nan = 1;
    }
    return amax;
}

/* E8M0 bytes of a group from its amaxes (group_amax's magnitude bits); the multipliers 2^(127-E) go to mult. */
INLINE __m512i group_scales(__m512i amax, int in_dt, int floor_r, float inv_max_norm, int emax, float *mult) {
    if (in_dt == IN_BF16)
        amax = _mm512_slli_epi32(amax, 16);
    else if (in_dt == IN_F16)
        amax = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(amax)));
    __m512i e = scale_bytes(amax, floor_r, inv_max_norm, emax);
    _mm512_store_ps(mult, multipliers(e));
    return e;
}

/* Store a group's E8M0 bytes (g of them) at er + b0. */
INLINE void store_scales(uint8_t *er, int64_t b0, int g, int full, __m512i e) {
    if (full)
        _mm_storeu_si128((__m128i *)(er + b0), _mm512_cvtepi32_epi8(e));
    else
        _mm_mask_storeu_epi8(er + b0, (__mmask16)((1u << g) - 1u), _mm512_cvtepi32_epi8(e));
}

/* Cast one row's group of blocks (re-read from L1) with the multipliers mult. */
INLINE void cast_group(const char *xr, uint8_t *qr, int64_t k, int64_t b0, int g, int full, int in_dt, int elem,
                       const float *mult, int nan) {
    const int esize = in_dt == IN_F32 ? 4 : 2;
    for (int j = 0; j < (full ? 16 : g); j++) {
        int64_t start = (b0 + j) * 32;
        int n = full ? 32 : (int)(k - start < 32 ? k - start : 32);
        __m512 m = _mm512_set1_ps(mult[j]);
        if (nan)
            cast_block(xr + start * esize, qr + start, n, full, in_dt, m, elem, 1);
        else
            cast_block(xr + start * esize, qr + start, n, full, in_dt, m, elem, 0);
    }
}

/* Prefetch of `lines` cache lines of input ROW_PREFETCH_BYTES ahead of p: the hardware prefetchers alone leave one
 * thread well short of the memory bandwidth, most of all on 4 KiB pages (they stop at page boundaries). Issued a
 * few lines at a time, as the input is read (a group's 32 lines in one burst were slower, and so was prefetching
 * the output for writing as well). A hint: never faults, so reading past the end is harmless. */
#define ROW_PREFETCH_BYTES 4096
INLINE void prefetch_ahead(const char *p, int lines) {
    for (int l = 0; l < lines; l++)
        __builtin_prefetch(p + ROW_PREFETCH_BYTES + 64 * l, 0, 3);
}

/* One group of g (1..16) blocks from block b0 of rows [r0, r0 + nr), which share their scales: nr = 1 for 1-D
 * blocks, up to 32 for 32x32 blocks (the amax of a block is the max over its rows; every row of the row group
 * stores the same scale bytes, as the eager kernel does). */
INLINE void group_rows(const char *x, int64_t r0, int nr, int64_t k, uint8_t *q, uint8_t *e, int64_t b0, int g,
                       int full, int in_dt, int elem, int floor_r, float inv_max_norm, int emax) {
    const int esize = in_dt == IN_F32 ? 4 : 2;
    const int64_t nb = (k + 31) / 32;
    __m512i amax = _mm512_setzero_si512();
    int nan = 0;
    for (int r = 0; r < nr; r++) {
        const char *xr = x + (r0 + r) * k * esize;
        __m512i a = full ? group_amax(xr, k, b0, 16, 1, in_dt, &nan) : group_amax(xr, k, b0, g, 0, in_dt, &nan);
        amax = _mm512_max_epu32(amax, a);
    }
    __attribute__((aligned(64))) float mult[16];
    __m512i eb = group_scales(amax, in_dt, floor_r, inv_max_norm, emax, mult);
    for (int r = 0; r < nr; r++) {
        const char *xr = x + (r0 + r) * k * esize;
        store_scales(e + (r0 + r) * nb, b0, g, full, eb);
        if (full)
            cast_group(xr, q + (r0 + r) * k, k, b0, 16, 1, in_dt, elem, mult, nan);
        else
            cast_group(xr, q + (r0 + r) * k, k, b0, g, 0, in_dt, elem, mult, nan);
    }
}

/* Blocks [b0, ceil(k/32)) of rows [r0, r0 + nr) (see group_rows), sixteen at a time. */
INLINE void quantize_row_group(const char *x, int64_t r0, int nr, int64_t k, uint8_t *q, uint8_t *e, int64_t b0,
                               int in_dt, int elem, int floor_r, float inv_max_norm, int emax) {
    const int64_t nb = (k + 31) / 32, full_groups = (k / 32) / 16;
    for (; b0 < nb; b0 += 16) {
        const int g = (int)(nb - b0 < 16 ? nb - b0 : 16);
        if (b0 / 16 < full_groups && b0 % 16 == 0)
            group_rows(x, r0, nr, k, q, e, b0, 16, 1, in_dt, elem, floor_r, inv_max_norm, emax);
        else
            group_rows(x, r0, nr, k, q, e, b0, g, 0, in_dt, elem, floor_r, inv_max_norm, emax);
    }
}

/* ---- float32 rows: sixteen blocks at a time in 32-bit integer lanes ----------------------------------------
 * The arithmetic of the AVX2 build's "float32 rows" (see there why it gives the bytes of the float32 path: the
 * product's FP8 code is an integer add of c = ((bias - E) << 23) + half - 1 to x's magnitude bits, "+ lsb, shift"
 * for ties to even), sixteen lanes wide. A group of sixteen blocks shares one amax reduction and one vector of
 * scales; each block's c is broadcast from memory. Codes are packed two blocks (four vectors) at a time with signed
 * saturating packs: the 16-bit codes are exact (those of the blocks kept lie in [-2048, 256)), the 16 -> 8-bit pack
 * turns codes <= 0 into 0 and the sign bytes come from the raw inputs through the same packs. A 16-bit code q in
 * [-(mbits << mbits), 2^mbits) is a product that may be a nonzero FP8 subnormal: a product above min_subnormal / 2
 * has an exponent of at least -bias - mbits, so q >= -(mbits << mbits), and one that rounds to min_normal or more
 * has q >= 2^mbits, which the float path gives too (its subnormal rounding of a product >= min_normal (1 -
 * 2^-(mbits+1)) is 2^mbits); zeros give q < -(mbits << mbits) (E > bias + mbits). A group with such a code, a scale
 * E <= bias + mbits (zero and float32-subnormal inputs could then look normal) or a NaN / Inf is cast over by the
 * float path (group_rows), byte for byte the same. */

struct f32x16_consts {
    __m512i mag_mask, one, sub_shift, sub_top, max_code, sign, order;
};

INLINE struct f32x16_consts f32x16_consts_for(int elem) {
    const int mbits = elem == EL_E4M3 ? 3 : 2;
    struct f32x16_consts k = {
        _mm512_set1_epi32(0x7FFFFFFF), _mm512_set1_epi32(1), _mm512_set1_epi16((short)(mbits << mbits)),
        _mm512_set1_epi16((short)((mbits << mbits) + (1 << mbits) - 1)),
        _mm512_set1_epi16(elem == EL_E4M3 ? 0x7E : 0x7B), _mm512_set1_epi8((char)0x80),
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)};
    return k;
}

/* FP8 codes (int32 lanes, <= 0 for code 0, unclamped) of sixteen float32 inputs r given their block's c: the
 * "+ lsb" of ties to even is a masked add of 1 where bit `shift` of r (that of |r|) is set. */
INLINE __m512i f32x16_codes(__m512i r, __m512i c, int shift, const struct f32x16_consts *k) {
    __m512i u = _mm512_add_epi32(_mm512_and_si512(r, k->mag_mask), c);
    u = _mm512_mask_add_epi32(u, _mm512_test_epi32_mask(r, _mm512_set1_epi32(1 << shift)), u, k->one);
    return _mm512_srai_epi32(u, shift);
}

/* Two full blocks at p (c0, c1: their c) into 64 bytes at out; folds their subnormal-check lanes into *sub
 * (unsigned 16-bit min: a lane <= sub_top marks a code that may be a nonzero FP8 subnormal). */
INLINE void f32x16_pair(const float *p, uint8_t *out, __m512i c0, __m512i c1, int elem, int saturate,
                        const struct f32x16_consts *k, __m512i *sub) {
    const int shift = elem == EL_E4M3 ? 20 : 21;
    __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 16);
    __m512i r2 = _mm512_loadu_si512(p + 32), r3 = _mm512_loadu_si512(p + 48);
    __m512i q01 = _mm512_packs_epi32(f32x16_codes(r0, c0, shift, k), f32x16_codes(r1, c0, shift, k));
    __m512i q23 = _mm512_packs_epi32(f32x16_codes(r2, c1, shift, k), f32x16_codes(r3, c1, shift, k));
    *sub = _mm512_min_epu16(*sub, _mm512_min_epu16(_mm512_add_epi16(q01, k->sub_shift),
                                                    _mm512_add_epi16(q23, k->sub_shift)));
    if (saturate) {
        q01 = _mm512_min_epi16(q01, k->max_code);
        q23 = _mm512_min_epi16(q23, k->max_code);
    }
    __m512i v = _mm512_packus_epi16(q01, q23);  /* per 128-bit lane L: elements 4L..4L+3 of r0, r1, r2, r3 */
    __m512i s = _mm512_packs_epi16(_mm512_packs_epi32(r0, r1), _mm512_packs_epi32(r2, r3));
    v = _mm512_ternarylogic_epi32(v, s, k->sign, 0xF8);  /* v | (s & 0x80) */
    _mm512_storeu_si512(out, _mm512_permutexvar_epi32(k->order, v));
}

/* A group's scales: e (E8M0 bytes, 32-bit lanes); special when the group holds a NaN or an Inf. (Worked out a group
 * ahead of the cast, as the AVX2 build does, they were slower from memory here: 0.55 against 0.49 ns/element.) */
struct plan16 {
    __m512i e;
    __mmask16 special;
};

INLINE struct plan16 f32x16_plan(const float *xr, int floor_r, float inv_max_norm, int emax) {
    const __m512i mag_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m[16];
    for (int j = 0; j < 16; j++)
        m[j] = _mm512_max_epu32(_mm512_and_si512(_mm512_loadu_si512(xr + 32 * j), mag_mask),
                                _mm512_and_si512(_mm512_loadu_si512(xr + 32 * j + 16), mag_mask));
    __m512i amax = reduce_max16(m, 0);
    struct plan16 plan = {scale_bytes(amax, floor_r, inv_max_norm, emax),
                          _mm512_cmpgt_epu32_mask(amax, _mm512_set1_epi32(0x7F7FFFFF))};
    return plan;
}

/* Sixteen full float32 blocks from xr into qr (FP8 bytes) and er (E8M0 bytes), with their plan. */
INLINE void f32x16_group(const float *xr, uint8_t *qr, uint8_t *er, struct plan16 plan, int elem, int floor_r,
                         float inv_max_norm, int emax, int saturate) {
    const int bias = elem == EL_E4M3 ? 7 : 15, mbits = elem == EL_E4M3 ? 3 : 2, half = 1 << (22 - mbits);
    if (plan.special) {
        group_rows((const char *)xr, 0, 1, 512, qr, er, 0, 16, 1, IN_F32, elem, floor_r, inv_max_norm, emax);
        return;
    }
    _mm_storeu_si128((__m128i *)er, _mm512_cvtepi32_epi8(plan.e));
    /* E <= 254: E << 23 fits in int32 */
    __attribute__((aligned(64))) int32_t c[16];
    _mm512_store_si512(c, _mm512_sub_epi32(_mm512_set1_epi32((bias << 23) + half - 1),
                                           _mm512_slli_epi32(plan.e, 23)));
    const struct f32x16_consts k = f32x16_consts_for(elem);
    __m512i sub = _mm512_set1_epi16(-1);
    for (int j = 0; j < 16; j += 2) {
        prefetch_ahead((const char *)(xr + 32 * j), 4);
        f32x16_pair(xr + 32 * j, qr + 32 * j, _mm512_set1_epi32(c[j]), _mm512_set1_epi32(c[j + 1]), elem,
                    saturate, &k, &sub);
    }
    if (!MXPORT_TEST_FAST_ONLY && (_mm512_cmplt_epi32_mask(plan.e, _mm512_set1_epi32(bias + mbits + 1)) ||
                                   _mm512_cmple_epu16_mask(sub, k.sub_top))) {
        __attribute__((aligned(64))) float mult[16];
        _mm512_store_ps(mult, multipliers(plan.e));
        cast_group((const char *)xr, qr, 512, 0, 16, 1, IN_F32, elem, mult, 0);
    }
}

/* One float32 row of k elements: groups of sixteen full blocks, then the rest (at most 15 blocks and a short
 * one) by group_rows. */
INLINE void f32x16_row(const float *xr, int64_t k, uint8_t *qr, uint8_t *er, int elem, int floor_r,
                       float inv_max_norm, int emax, int saturate) {
    const int64_t groups = k / 512;
    for (int64_t i = 0; i < groups; i++)
        f32x16_group(xr + 512 * i, qr + 512 * i, er + 16 * i, f32x16_plan(xr + 512 * i, floor_r, inv_max_norm,
                     emax), elem, floor_r, inv_max_norm, emax, saturate);
    quantize_row_group((const char *)xr, 0, 1, k, qr, er, 16 * groups, IN_F32, elem, floor_r, inv_max_norm, emax);
}

/* One float32 row; with rceil and the exact f32(1/max_norm) the codes need no clamp (see the AVX2 build's
 * quantize_fast_row), so it is left out. */
INLINE void f32x16_fast_row(const float *xr, int64_t k, uint8_t *qr, uint8_t *er, int elem, int floor_r,
                            float inv_max_norm, int emax) {
    if (floor_r || inv_max_norm != 1.0f / (elem == EL_E4M3 ? 448.0f : 57344.0f))
        f32x16_row(xr, k, qr, er, elem, floor_r, inv_max_norm, emax, 1);
    else
        f32x16_row(xr, k, qr, er, elem, floor_r, inv_max_norm, emax, 0);
}

INLINE void quantize_rows_impl(const char *x, int64_t rows, int64_t k, uint8_t *q, uint8_t *e, int in_dt,
                               int elem, int floor_r, float inv_max_norm, int emax, int block_2d) {
    if (in_dt == IN_F32 && !block_2d) {
        const float *xf = (const float *)x;
        if (k % 32 == 0) {  /* rows of whole blocks: one long row of rows * k */
            f32x16_fast_row(xf, rows * k, q, e, elem, floor_r, inv_max_norm, emax);
            return;
        }
        for (int64_t r = 0; r < rows; r++)
            f32x16_fast_row(xf + r * k, k, q + r * k, e + r * ((k + 31) / 32), elem, floor_r, inv_max_norm, emax);
        return;
    }
    const int group = block_2d ? 32 : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += group)
        quantize_row_group(x, r0, (int)(rows - r0 < group ? rows - r0 : group), k, q, e, 0, in_dt, elem, floor_r,
                           inv_max_norm, emax);
}

#endif /* MXPORT_HAVE_KERNEL == 1 */

#if MXPORT_HAVE_KERNEL
#define MXPORT_CASE(IN, EL, FL) \
    case (IN) * 4 + (EL) * 2 + (FL): \
        quantize_rows_impl(x, rows, k, q, e, IN, EL, FL, inv_max_norm, emax, block_2d); \
        return 0;
#endif

/*
 * Quantize `rows` contiguous rows of `k` elements (x: float32 / bfloat16 / float16 by in_dtype 0 / 1 / 2) into
 * q (rows x k FP8 bytes, E4M3 for elem 0, E5M2 for elem 1) and e (rows x ceil(k/32) E8M0 bytes).
 * floor_rounding: 0 = rceil, 1 = floor. inv_max_norm: f32(1 / max_norm); emax: the element's emax (8 / 15).
 * block_2d: 1 = 32x32 blocks (rows taken in groups of 32 from the first; each row stores its group's scales).
 * Returns 0, or -1 for arguments it does not handle (the caller then uses another path).
 */
int mxport_quantize_rows(const void *x, int64_t rows, int64_t k, uint8_t *q, uint8_t *e, int in_dtype, int elem,
                         int floor_rounding, float inv_max_norm, int emax, int block_2d) {
#if MXPORT_HAVE_KERNEL
    if (rows < 0 || k < 1 || in_dtype < 0 || in_dtype > 2 || elem < 0 || elem > 1 || floor_rounding < 0 ||
        floor_rounding > 1 || block_2d < 0 || block_2d > 1)
        return -1;
    switch (in_dtype * 4 + elem * 2 + floor_rounding) {
        MXPORT_CASE(IN_F32, EL_E4M3, 0) MXPORT_CASE(IN_F32, EL_E4M3, 1)
        MXPORT_CASE(IN_F32, EL_E5M2, 0) MXPORT_CASE(IN_F32, EL_E5M2, 1)
        MXPORT_CASE(IN_BF16, EL_E4M3, 0) MXPORT_CASE(IN_BF16, EL_E4M3, 1)
        MXPORT_CASE(IN_BF16, EL_E5M2, 0) MXPORT_CASE(IN_BF16, EL_E5M2, 1)
        MXPORT_CASE(IN_F16, EL_E4M3, 0) MXPORT_CASE(IN_F16, EL_E4M3, 1)
        MXPORT_CASE(IN_F16, EL_E5M2, 0) MXPORT_CASE(IN_F16, EL_E5M2, 1)
    }
    return -1;
#else
    (void)x; (void)rows; (void)k; (void)q; (void)e; (void)in_dtype; (void)elem; (void)floor_rounding;
    (void)inv_max_norm; (void)emax; (void)block_2d;
    return -1;
#endif
}

/*
 * Word sums of a byte stream (the refit checksum's partial sums, mxport.refit.buckets): the stream is cut into
 * buckets of bucket_bytes and each bucket into chunks of chunk_bytes (the last ones shorter); a chunk's sum is
 * the wrapping sum of its little-endian 64-bit words. Both sizes are multiples of 8, so no word crosses a chunk.
 * Sums are linear, so any byte range contributes on its own: byte i of a range at stream offset off adds
 * byte << 8 * ((off + i) % 8) to the sum of its chunk (global index bucket * ceil(bucket_bytes / chunk_bytes) +
 * chunk).
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

struct mxport_sums {
    int64_t bucket_bytes;
    int64_t chunk_bytes;
    int64_t n;    /* entries of out */
    int64_t *out; /* per-chunk sums, added to */
};

/* The word-sum contribution of n bytes at p whose first byte sits at stream offset off (off % 8 = rho). */
static uint64_t span_words(const uint8_t *p, int64_t n, int64_t rho) {
    uint64_t s = 0;
    int64_t i = 0;
    for (; i < n && (rho + i) % 8; i++)
        s += (uint64_t)p[i] << (8 * ((rho + i) % 8));
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + i)),
                                     _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        __m256i b = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + i + 64)),
                                     _mm256_loadu_si256((const __m256i *)(p + i + 96)));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(a, b));
    }
    for (; i + 32 <= n; i += 32)
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(p + i)));
    __attribute__((aligned(32))) uint64_t lanes[4];
    _mm256_store_si256((__m256i *)lanes, acc);
    s += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        s += w;
    }
    for (; i < n; i++)
        s += (uint64_t)p[i] << (8 * ((rho + i) % 8));
    return s;
}

/* Add the word sums of n bytes at p (stream offset off) to their chunks; -1 when a chunk is out of range. */
static int add_span(const struct mxport_sums *sums, const uint8_t *p, int64_t n, int64_t off) {
    const int64_t bb = sums->bucket_bytes, cb = sums->chunk_bytes, per = (bb + cb - 1) / cb;
    while (n > 0) {
        const int64_t b = off / bb, c = (off - b * bb) / cb;
        const int64_t end = b * bb + ((c + 1) * cb < bb ? (c + 1) * cb : bb);
        const int64_t take = n < end - off ? n : end - off, idx = b * per + c;
        if (idx >= sums->n)
            return -1;
        sums->out[idx] = (int64_t)((uint64_t)sums->out[idx] + span_words(p, take, off % 8));
        p += take, off += take, n -= take;
    }
    return 0;
}

/* Stream bytes summed right after they are written: rows are quantized in tiles of about this many output bytes,
 * each tile summed while it is still in L1 / L2 (a multiple of 32 rows for 32x32 blocks). */
#define SUM_TILE_BYTES 16384

/*
 * One job of mxport_quantize_many: `rows` contiguous rows of `k` elements at x (in_dtype as in
 * mxport_quantize_rows) into q (rows x k FP8 bytes) and e (rows x ceil(k/32) E8M0 bytes). q_off / e_off: the
 * stream offsets of q and e, read only when the call sums its output. 64 bytes, no padding holes
 * (mxport/native.py mirrors it with ctypes).
 */
struct mxport_job {
    const void *x;
    int64_t rows;
    int64_t k;
    uint8_t *q;
    uint8_t *e;
    int32_t in_dtype;
    int32_t reserved; /* 0 */
    int64_t q_off;
    int64_t e_off;
};

/* sizeof(struct mxport_job), for the caller's check of its mirror of the struct */
int mxport_job_size(void) { return (int)sizeof(struct mxport_job); }

/* One job with its output summed tile by tile (see SUM_TILE_BYTES). */
static int quantize_job_summed(const struct mxport_job *j, int elem, int floor_rounding, float inv_max_norm,
                               int emax, int block_2d, const struct mxport_sums *sums) {
    const int64_t k = j->k, nb = (k + 31) / 32, esize = j->in_dtype == IN_F32 ? 4 : 2, group = block_2d ? 32 : 1;
    int64_t tile = SUM_TILE_BYTES / k / group * group;
    tile = tile < group ? group : tile;
    for (int64_t r0 = 0; r0 < j->rows; r0 += tile) {
        const int64_t nr = j->rows - r0 < tile ? j->rows - r0 : tile;
        if (mxport_quantize_rows((const char *)j->x + r0 * k * esize, nr, k, j->q + r0 * k, j->e + r0 * nb,
                                 j->in_dtype, elem, floor_rounding, inv_max_norm, emax, block_2d) != 0 ||
            add_span(sums, j->q + r0 * k, nr * k, j->q_off + r0 * k) != 0 ||
            add_span(sums, j->e + r0 * nb, nr * nb, j->e_off + r0 * nb) != 0)
            return -1;
    }
    return 0;
}

/*
 * Quantize n jobs (several tensors, or row ranges of them) in one call, one after the other, with the shared
 * format parameters of mxport_quantize_rows (elem, floor_rounding, inv_max_norm, emax, block_2d). sums: NULL, or
 * where to add the word sums of every output byte at its stream offset (the job's q_off / e_off; summed while
 * the bytes are in cache). Every job is checked before any is run: returns 0, or -1 (nothing written) when one
 * is out of range (a chunk out of range is found while running: -1 then too).
 */
int mxport_quantize_many(int64_t n, const struct mxport_job *jobs, int elem, int floor_rounding,
                         float inv_max_norm, int emax, int block_2d, const struct mxport_sums *sums) {
    if (n < 0 || (n > 0 && jobs == 0))
        return -1;
    if (sums && (sums->bucket_bytes < 8 || sums->bucket_bytes % 8 || sums->chunk_bytes < 8 ||
                 sums->chunk_bytes % 8 || sums->n < 0 || (sums->n > 0 && sums->out == 0)))
        return -1;
    for (int64_t i = 0; i < n; i++) {
        const struct mxport_job *j = &jobs[i];
        if (j->rows < 0 || j->k < 1 || j->in_dtype < 0 || j->in_dtype > 2 || j->reserved != 0 ||
            (j->rows > 0 && (j->x == 0 || j->q == 0 || j->e == 0)) || (sums && (j->q_off < 0 || j->e_off < 0)))
            return -1;
    }
    if (elem < 0 || elem > 1 || floor_rounding < 0 || floor_rounding > 1 || block_2d < 0 || block_2d > 1)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        const struct mxport_job *j = &jobs[i];
        if (j->rows == 0)
            continue;
        int rc = sums ? quantize_job_summed(j, elem, floor_rounding, inv_max_norm, emax, block_2d, sums)
                      : mxport_quantize_rows(j->x, j->rows, j->k, j->q, j->e, j->in_dtype, elem, floor_rounding,
                                             inv_max_norm, emax, block_2d);
        if (rc != 0)
            return -1;
    }
    return 0;
}

/*
 * Scale layouts (mxport.layouts): the cuBLAS / FlashInfer 128x4-tile swizzle of an E8M0 grid and its inverse,
 * in one pass over the bytes. A grid of R x C scales, padded to PR = roundup(R, 128) rows and PC = roundup(C, 4)
 * columns, is cut into 128 x 4 tiles, stored in row-major tile order, 512 bytes each; entry (r, c) lands at byte
 * ((r / 128) * (PC / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4, padding bytes 0. So the
 * 16 bytes at chunk i of a tile are the 4-byte words of its rows i, i + 32, i + 64, i + 96: with the grid's rows
 * contiguous, four 16-byte loads (one per row: the same word of four tiles side by side) and a 4 x 4 transpose of
 * 32-bit words give one 16-byte chunk of each of four tiles. Edges (rows past R, columns past C, strided grids) go
 * one word / one byte at a time.
 */
#if defined(__SSE2__)
#define SWIZZLE_SSE2 1
#include <emmintrin.h>

/* 4 x 4 transpose of 32-bit words: row j of the result holds word j of a, b, c, d. */
static inline void transpose4x4(__m128i *a, __m128i *b, __m128i *c, __m128i *d) {
    __m128i ab0 = _mm_unpacklo_epi32(*a, *b), ab1 = _mm_unpackhi_epi32(*a, *b);
    __m128i cd0 = _mm_unpacklo_epi32(*c, *d), cd1 = _mm_unpackhi_epi32(*c, *d);
    *a = _mm_unpacklo_epi64(ab0, cd0);
    *b = _mm_unpackhi_epi64(ab0, cd0);
    *c = _mm_unpacklo_epi64(ab1, cd1);
    *d = _mm_unpackhi_epi64(ab1, cd1);
}
#else
#define SWIZZLE_SSE2 0 /* no 4-tile path: every tile a word / a byte at a time */
#endif

/* The four bytes of row r, columns c0 .. c0 + 3 of a strided grid (0 past its rows / columns). */
static uint32_t grid_word(const uint8_t *src, int64_t rows, int64_t cols, int64_t rs, int64_t cs, int64_t r,
                          int64_t c0) {
    uint8_t b[4] = {0, 0, 0, 0};
    for (int j = 0; r < rows && j < 4 && c0 + j < cols; j++)
        b[j] = src[r * rs + (c0 + j) * cs];
    uint32_t w;
    memcpy(&w, b, 4);
    return w;
}

/* Tiles [t0, t1) of tile row a (nt tiles a tile row), a word at a time. */
static void swizzle_tiles_slow(const uint8_t *src, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                               uint8_t *dst, int64_t a, int64_t t0, int64_t t1, int64_t nt) {
    for (int64_t t = t0; t < t1; t++) {
        uint8_t *tile = dst + (a * nt + t) * 512;
        for (int i = 0; i < 32; i++)
            for (int b = 0; b < 4; b++) {
                uint32_t w = grid_word(src, rows, cols, rs, cs, 128 * a + 32 * b + i, 4 * t);
                memcpy(tile + 16 * i + 4 * b, &w, 4);
            }
    }
}

/* Tiles [0, 4 * n4) of tile row a, whose 128 rows are all in the grid and contiguous: four tiles at a time, in
 * strips of sixteen tiles (64 columns): each row's 64 bytes of a strip are read in one go, so no cache line of
 * the grid is read twice (rows 1 KiB or more apart share a few cache sets, and are gone by the next strip), and
 * the strip's 8 KiB of tiles are written whole while in L1. (Chunk i of every tile of the row before chunk i + 1,
 * as unswizzle_tiles_fast goes, was slower here: 8.6 against 7.4 ms for a 32768 x 1024 grid.) */
static void swizzle_tiles_fast(const uint8_t *src, int64_t rs, uint8_t *dst, int64_t a, int64_t n4, int64_t nt) {
#if defined(__SSE2__)
    for (int64_t s0 = 0; s0 < n4; s0 += 4)
        for (int i = 0; i < 32; i++)
            for (int64_t t = 4 * s0; t < 4 * (s0 + 4 < n4 ? s0 + 4 : n4); t += 4) {
                const uint8_t *s = src + (128 * a + i) * rs + 4 * t;
                uint8_t *o = dst + (a * nt + t) * 512 + 16 * i;
                __m128i w0 = _mm_loadu_si128((const __m128i *)s);
                __m128i w1 = _mm_loadu_si128((const __m128i *)(s + 32 * rs));
                __m128i w2 = _mm_loadu_si128((const __m128i *)(s + 64 * rs));
                __m128i w3 = _mm_loadu_si128((const __m128i *)(s + 96 * rs));
                transpose4x4(&w0, &w1, &w2, &w3);
                _mm_storeu_si128((__m128i *)o, w0);
                _mm_storeu_si128((__m128i *)(o + 512), w1);
                _mm_storeu_si128((__m128i *)(o + 1024), w2);
                _mm_storeu_si128((__m128i *)(o + 1536), w3);
            }
#else
    (void)src, (void)rs, (void)dst, (void)a, (void)n4, (void)nt;  /* n4 is 0 (see mxport_swizzle) */
#endif
}

/*
 * Swizzle the rows x cols grid at src (byte (r, c) at src[r * rs + c * cs]) into dst, roundup(rows, 128) *
 * roundup(cols, 4) bytes, padding included. Returns 0, or -1 for a negative size or stride.
 */
int mxport_swizzle(const uint8_t *src, int64_t rows, int64_t cols, int64_t rs, int64_t cs, uint8_t *dst) {
    if (rows < 0 || cols < 0 || rs < 0 || cs < 0)
        return -1;
    const int64_t ntr = (rows + 127) / 128, nt = (cols + 3) / 4;
    for (int64_t a = 0; a < ntr; a++) {
        const int64_t n4 = SWIZZLE_SSE2 && cs == 1 && 128 * a + 128 <= rows ? cols / 16 : 0;
        swizzle_tiles_fast(src, rs, dst, a, n4, nt);
        swizzle_tiles_slow(src, rows, cols, rs, cs, dst, a, 4 * n4, nt, nt);
    }
    return 0;
}

/* Tiles [t0, t1) of tile row a (nt tiles a tile row) back into the rows x cols grid dst, a byte at a time. */
static void unswizzle_tiles_slow(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst, int64_t a,
                                 int64_t t0, int64_t t1, int64_t nt) {
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = src + (a * nt + t) * 512;
        for (int64_t r = 128 * a; r < rows && r < 128 * a + 128; r++)
            for (int64_t c = 4 * t; c < cols && c < 4 * t + 4; c++)
                dst[r * cols + c] = tile[(r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4];
    }
}

/* Tiles [0, 4 * n4) of tile row a, whose 128 rows are all in the grid: four tiles at a time, chunk i of every
 * tile of the row before chunk i + 1, so that the grid is written along its rows (four streams, whole cache
 * lines) while the tile row (128 x cols bytes) is read again from L1 / L2. (Strips of sixteen tiles, as
 * swizzle_tiles_fast goes, were slower here: 8.2 against 6.8 ms for a 32768 x 1024 grid.) */
static void unswizzle_tiles_fast(const uint8_t *src, int64_t cols, uint8_t *dst, int64_t a, int64_t n4,
                                 int64_t nt) {
#if defined(__SSE2__)
    for (int i = 0; i < 32; i++) {
        const uint8_t *s = src + a * nt * 512 + 16 * i;
        uint8_t *o = dst + (128 * a + i) * cols;
        for (int64_t t = 0; t < 4 * n4; t += 4) {
            __m128i w0 = _mm_loadu_si128((const __m128i *)(s + 512 * t));
            __m128i w1 = _mm_loadu_si128((const __m128i *)(s + 512 * t + 512));
            __m128i w2 = _mm_loadu_si128((const __m128i *)(s + 512 * t + 1024));
            __m128i w3 = _mm_loadu_si128((const __m128i *)(s + 512 * t + 1536));
            transpose4x4(&w0, &w1, &w2, &w3);
            _mm_storeu_si128((__m128i *)(o + 4 * t), w0);
            _mm_storeu_si128((__m128i *)(o + 32 * cols + 4 * t), w1);
            _mm_storeu_si128((__m128i *)(o + 64 * cols + 4 * t), w2);
            _mm_storeu_si128((__m128i *)(o + 96 * cols + 4 * t), w3);
        }
    }
#else
    (void)src, (void)cols, (void)dst, (void)a, (void)n4, (void)nt;  /* n4 is 0 (see mxport_unswizzle) */
#endif
}

/*
 * The inverse of mxport_swizzle: roundup(rows, 128) * roundup(cols, 4) swizzled bytes at src into the contiguous
 * rows x cols grid dst. Returns 0, or -1 for a negative size.
 */
int mxport_unswizzle(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows < 0 || cols < 0)
        return -1;
    const int64_t ntr = (rows + 127) / 128, nt = (cols + 3) / 4;
    for (int64_t a = 0; a < ntr; a++) {
        const int64_t n4 = SWIZZLE_SSE2 && 128 * a + 128 <= rows ? cols / 16 : 0;
        unswizzle_tiles_fast(src, cols, dst, a, n4, nt);
        unswizzle_tiles_slow(src, rows, cols, dst, a, 4 * n4, nt, nt);
    }
    return 0;
}

/* The attestation digest's word sums (mxport.refit.attest): over n 64-bit words, out[0] += sum w[i] and
 * out[1] += sum w[i] * (first + i), both wrapping. One pass at memory speed (vectorized by the compiler);
 * torch's int64 ops took about 10x longer for the position-weighted sum (a position tensor per chunk). */
void mxport_word_digest(const uint64_t *w, int64_t n, uint64_t first, uint64_t *out) {
    uint64_t plain = 0, weighted = 0;
    for (int64_t i = 0; i < n; i++) {
        plain += w[i];
        weighted += w[i] * (first + (uint64_t)i);
    }
    out[0] += plain;
    out[1] += weighted;
}

/* Delta refit (mxport.refit.stream.delta): the 8-byte words of `now` that differ from `base` over n words.
 * The first changed words (at most cap of them, with at most cap_vals changed bytes) are recorded: index to
 * idx, byte mask to masks (bit j: byte j in memory order), changed bytes to vals; every changed word is
 * copied into base, so that after the call base equals now. Returns how many words changed; rec[0] / rec[1]
 * the words / bytes recorded (fewer words than changed: the caller sends the range whole). One pass at
 * memory speed: the common word is unchanged. */
int64_t mxport_delta_diff(uint64_t *base, const uint64_t *now, int64_t n, int32_t *idx, uint8_t *masks,
                          uint8_t *vals, int64_t cap, int64_t cap_vals, int64_t *rec) {
    int64_t k = 0, r = 0, v = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint64_t a = base[i], b = now[i];
        if (a == b) continue;
        base[i] = b;
        k++;
        if (r < k - 1 || r >= cap || v + 8 > cap_vals) continue;  /* past the caps: count only */
        const uint8_t *nb = (const uint8_t *)&now[i], *ab = (const uint8_t *)&a;
        uint8_t m = 0;
        for (int j = 0; j < 8; j++) {
            if (nb[j] != ab[j]) { m |= (uint8_t)(1u << j); vals[v++] = nb[j]; }
        }
        idx[r] = (int32_t)i;
        masks[r++] = m;
    }
    rec[0] = r;
    rec[1] = v;
    return k;
}

/* Delta refit: write k changed words into dst (uint8, whole words): word idx[i] takes, in memory order, the
 * next bytes of vals at the bytes its mask masks[i] sets. The caller checked idx, masks and vals (parse). */
void mxport_delta_apply(uint8_t *dst, const int32_t *idx, const uint8_t *masks, const uint8_t *vals,
                        int64_t k) {
    int64_t v = 0;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *w = dst + 8 * (int64_t)idx[i];
        const uint8_t m = masks[i];
        for (int j = 0; j < 8; j++) {
            if (m & (1u << j)) w[j] = vals[v++];
        }
    }
}

/* ---- 4-bit rows: MXFP4 and NVFP4 (mxport.fp4), scalar C, the float32 steps of the torch reference -------------
 * E2M1 codes round to nearest, ties to the even code, saturate at +-6; the sign bit is set for x < 0 (so -0.0 is
 * code 0 and a tiny negative that rounds to zero is code 8, as the reference). Two codes a byte, low nibble first.
 * fmt 0: MXFP4 rceil (E = the smallest with 2^(E-127) >= f32(amax / 6)); 1: MXFP4 floor (OCP: floor(log2 amax) - 2);
 * 2: NVFP4 with the float32 global scale g (block scale f32(amax / f32(6 * g)), 1 for 0, clamped to [2^-9, 448],
 * rounded to E4M3; elements x / f32(scale * g)). Rows are float32, K a multiple of the block (32; NVFP4 16).
 * Returns 0, 1 for bad arguments, 2 on a NaN or Inf (the output is then partial). Built with -std=c11: no FMA
 * contraction. */
static inline uint32_t fp4_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float fp4_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* E2M1 codes of n <= 32 floats (already divided by the block's scale), branch-free so that the loop vectorizes. */
static inline void fp4_codes(const float *v, int n, uint8_t *c) {
    for (int i = 0; i < n; i++) {
        float m = v[i] < 0.0f ? -v[i] : v[i];
        int k = (m > 0.25f) + (m > 0.75f) + (m > 1.25f) + (m > 1.75f) + (m > 2.5f) + (m > 3.5f) + (m > 5.0f);
        k += (m == 0.75f) | (m == 1.75f) | (m == 3.5f);
        c[i] = (uint8_t)(k | ((v[i] < 0.0f) << 3));
    }
}

static inline int fp4_e8m0_rceil(float v) {
    uint32_t b = fp4_bits(v), m = b & 0x7FFFFFu;
    int exp = (int)((b >> 23) & 0xFF);
    int e = exp + (m > 0 && (exp != 0 || m > 0x400000u));
    return e > 254 ? 254 : e;
}

static inline int fp4_e8m0_floor(float amax) {
    int exp = (int)((fp4_bits(amax) >> 23) & 0xFF);
    int e = exp - 2;
    return exp == 0 || e < 0 ? 0 : (e > 254 ? 254 : e);
}

static inline float fp4_e8m0_value(int e) { return fp4_float(e == 0 ? 0x00400000u : (uint32_t)e << 23); }

static inline uint8_t fp4_to_e4m3(float v) { /* v in [2^-9, 448] */
    if (v < 0.015625f) {                       /* E4M3 subnormals: a multiple of 2^-9, ties to even */
        float t = v * 512.0f, f = (float)(int)t, d = t - f;
        int n = (int)f + (d > 0.5f || (d == 0.5f && ((int)f & 1)));
        return (uint8_t)n;                     /* 8 is 0x08: the smallest normal, 2^-6 */
    }
    uint32_t b = fp4_bits(v);
    b += 0x7FFFFu + ((b >> 20) & 1u);
    return (uint8_t)((((int)((b >> 23) & 0xFF) - 120) << 3) | (int)((b >> 20) & 7u));
}

static inline float fp4_e4m3_value(uint8_t s) {
    int exp = (s >> 3) & 15, man = s & 7;
    return exp == 0 ? (float)man * 0.001953125f : fp4_float((uint32_t)(exp + 120) << 23 | (uint32_t)man << 20);
}

int mxport_fp4_rows(const float *x, int64_t rows, int64_t k, int fmt, float g, uint8_t *q, uint8_t *s) {
    const int block = fmt == 2 ? 16 : 32;
    if (k <= 0 || k % block || fmt < 0 || fmt > 2) return 1;
    const float six_g = 6.0f * g;
    float v[32];
    uint8_t c[32];
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        uint8_t *qr = q + r * (k / 2), *sr = s + r * (k / block);
        for (int64_t b0 = 0; b0 < k; b0 += block) {
            const float *xb = xr + b0;
            uint32_t amax_bits = 0, bits;
            for (int i = 0; i < block; i++) {  /* |x| as unsigned bits: ordered like the floats (finite) */
                memcpy(&bits, xb + i, 4);
                bits &= 0x7FFFFFFFu;
                amax_bits = bits > amax_bits ? bits : amax_bits;
            }
            if (amax_bits >= 0x7F800000u) return 2;  /* NaN or Inf: E2M1 cannot encode it */
            float amax = fp4_float(amax_bits), denom;
            if (fmt == 2) {
                float bs = amax / six_g;
                bs = bs == 0.0f ? 1.0f : bs;
                bs = bs < 0.001953125f ? 0.001953125f : (bs > 448.0f ? 448.0f : bs);
                uint8_t sb = fp4_to_e4m3(bs);
                sr[b0 / block] = sb;
                denom = fp4_e4m3_value(sb) * g;
            } else {
                int e = fmt == 0 ? fp4_e8m0_rceil(amax / 6.0f) : fp4_e8m0_floor(amax);
                sr[b0 / block] = (uint8_t)e;
                denom = fp4_e8m0_value(e);
            }
            for (int i = 0; i < block; i++) v[i] = xb[i] / denom;
            fp4_codes(v, block, c);
            for (int i = 0; i < block / 2; i++) qr[b0 / 2 + i] = (uint8_t)(c[2 * i] | c[2 * i + 1] << 4);
        }
    }
    return 0;
}
