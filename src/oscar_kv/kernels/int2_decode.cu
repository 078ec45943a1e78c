// Decode attention over the paged INT2 + BF16 pool in one launch, written for the tensor cores' mma.sync
// fragments.  Host side, math and layout: int2_cuda.py.  Compiled at run time by NVRTC with these macros:
//   D (head dim, 64, 128 or 256), P (page size), GQA (query heads per CTA, <= 8), SINK_PAGES, NWARPS, MAX_PAGES,
//   MIN_BLOCKS, Q_KIND / O_KIND (query / output dtype: 0 float32, 1 bfloat16, 2 float16), KBITS (key code width:
//   2, 3, 4, 5 or 8), VBITS (value code width: 2, 3 or 4), QGROUPS (CTAs that share a KV head's query heads, GQA each),
//   SLIDING (1: the layer attends to its last ``window`` tokens only); at D = 256 also NG (metadata groups per
//   token: 1, or 2 for G = 128) and STEP16 (16-token INT2 steps).
//
// One CTA = (split, KV head x query group, sequence).  It rotates the GQA group's query itself (q @ R_K, R from L2 while its
// first code loads are in flight), takes its share of the BF16 window (16-token sub-tiles dealt round-robin
// over the sequence's CTAs and warps), then its chunk of the INT2 history: warps take 32-token steps in turn
// (two 16-token sub-tiles) and keep their own online softmax, the CTA combines them and writes one partial per
// query head.  The last CTA of a (sequence, KV head) to finish (an atomic counter) merges the partials into
// the output, so a decode call is this one launch.
// Per INT2 sub-tile and warp:
//   keys    S^T[16 tok, 8 heads] = C[16 tok, D] . q^T   m16n8k16: codes are the A operand (tokens = rows),
//           the query the B operand.  The MMA's k order is free, so each thread feeds the bytes it loaded
//           itself (8 contiguous bytes of two tokens) and its query fragment lists the same channels.
//   values  O^T[D, 8 heads] += C^T[D, 16 tok] . PP[16 tok, 8 heads]: codes again the A operand (channels =
//           rows, any order), PP = p * scale_v moved from the key MMA's output layout to the B layout by
//           movmatrix.trans.
// A code byte holds channels j, j + D/4, j + D/2, j + 3D/4 (slices 0..3, bits 2s..2s+1).  (x & (3 << 2s))
// | 0x6400 is the float16 1024 + c * 4^s (exact): one LOP3 per two codes.  The 4^s is folded into the query
// slice (keys) or undone at the end (values); the 1024 offset is removed by starting the key MMA at
// -1024 * sum(q) and by an MMA of a constant-1024 A operand with PP (values).
// Keys at 3 or 4 bits (KBITS, one compiled variant per width; KBITS = 2 compiles to the INT2 kernel's machine code)
// feed the same MMAs in the same k order with the same query fragments: a code c < 16 of slice s is still the
// float16 1024 + c * 4^s, exact since c * 4^s <= 15 * 64 < 1024 keeps it in [1024, 2048) where the float16 step is
// 1, so the 1024 offset and its removal (-1024 * sum(q)) do not change.  Only the bytes a thread loads and the
// bits it ORs in do (key_a):
//   INT3  a token row is the INT2 plane (D/4 bytes, read exactly as INT2) then the high-bit plane (D/8 bytes: byte
//         j holds channel j + m D/8 in bit m).  Channel j + D4 s (j < D/4) has its high bit in byte j % (D/8), bit
//         2s + j / (D/8): thread t (j in [KB t, KB t + KB), KB = D/16) loads the KB bytes from D/4 + KB (t & 1)
//         and reads bit 2s + (t >> 1) of byte m for its byte m of the INT2 plane.  Shifted to bit 2s + 2 it is
//         the + 4 * 4^s of code value 4: (x & 3 << 2s) | (h & 4 << 2s) | 0x6400, two LOP3 per two codes.
//   INT4  byte j < D/2 holds channel j (low nibble) and j + D/2 (high nibble): slices 0 and 2 are the low and
//         high nibbles of bytes j < D/4, already at bits 4s; slices 1 and 3 those of bytes D/4 + j, shifted up by
//         2.  Thread t loads KB bytes from KB t and from D/4 + KB t: one LOP3 per two codes, as INT2.
//   INT5  the INT4 plane (D/2 bytes, read as INT4) then a high-bit plane as INT3's (D/8 bytes, from D/2 + KB (t & 1)).
//         A 5-bit code times 4^s passes 1023 at s = 3, so slice s's code is scaled by 2^pos(s), pos = 0, 1, 4, 5
//         (key_shift) instead: the upper bytes shift up by 1, not 2 (slices 1, 3 at bits 1-4, 5-8), and the high bit
//         of slice s (bit 2s + (t >> 1) of its byte) moves to bit pos(s) + 4; c * 2^pos(s) <= 31 * 32 < 1024.  The
//         query slices are divided by 2^pos(s) to match (key_a5).
//   INT8  byte j holds channel j.  Thread t loads KB bytes from KB t + D/4 s for each slice s, and a PRMT puts two
//         of them under the 0x64 exponent byte: the float16 1024 + c exactly (c <= 255), so the query slices are
//         not divided by 4^s.
// Their key rows are D * KBITS / 8 bytes, so key pages and heads have their own strides (stride_kcp, stride_kch,
// extra arguments of every variant but K2V2, whose two code pools share stride_cp, stride_ch).
// Values at 3 or 4 bits (VBITS, one compiled variant per width; VBITS = 2 compiles to the INT2 kernel's machine code)
// feed the same value MMAs: the codes of slice s become the same float16 1024 + c * 4^s (c <= 15, exact as for keys),
// so the constant-1024 offset MMA, the p * min_v sums and the final / 4^s do not change.  Value rows are VROW =
// D * VBITS / 8 bytes (stride_cp, stride_ch are the value pool's); a thread loads, beside its VB bytes of the INT2
// plane or the low bytes, VB more bytes of the same tokens (SubTile.vx), byte-permuted as the first ones (za, zb):
//   INT3  channel j + D4 s (j in [VB g, VB g + VB)) has its high bit in high-plane byte j % (D/8) = VB (g & 3) + by,
//         bit 2s + (g >> 2).  Shifted left by 2 - (g >> 2), that bit sits at 2s + 2 for every slice; one LOP3 per
//         parity merges the INT2 bits (2s, 2s + 1 of slices 0, 2 or of slices 1, 3) with the shifted high bits, and
//         one more per two codes masks slice s's three bits under 0x6400 (value_a).
//   INT4  bytes VB g + by hold slices 0 and 2 (low and high nibble, already at bits 4s), bytes D/4 + VB g + by slices 1
//         and 3, shifted up by 2: one LOP3 per two codes, as INT2.
// GQA above 8 (GLM-4: 16) does not fit one n8 MMA column block: QGROUPS CTAs share the KV head, each with GQA of
// its query heads.  They read the same codes at about the same time, so the second read mostly hits L2.
// SLIDING: the query (position T - 1) sees tokens >= lo = T - window.  The history splits start at lo's page, the
// sink is skipped once lo passes it, recent sub-tiles wholly below lo are skipped, and the tokens below lo in the
// sub-tiles that remain are masked (their logits -inf; a warp that has seen only masked tokens keeps m = -inf, so
// its exponents are taken against 0: safe_max).
// Head dim 256 (every D = 256 difference is behind #if, so D = 64 and 128 compile to the machine code they had):
//   - NG = 2 (G = 128, Gemma 3's calibration default): a token has two scales and two zero points per side (the
//     thread's two tokens' scales one 8-byte word, their zero points one 4-byte word).  Slices 0, 1 are channels
//     < 128 (group 0), slices 2, 3 group 1, so the key MMAs of s = 0 sum into c and those of s = 2 into ch, each
//     started at -1024 * sum of its group's float16 query entries; logit = ks_0 (c + kz_0 qz_0) + ks_1 (ch + kz_1
//     qz_1).  The value MMAs' B operand PP = p * scale_v is made per group (bv, bvh): accumulator blocks of even i
//     hold slices 0, 1 and take group 0's, odd i group 1's; the pending offset (pend, pend_hi) and the PP * zero_v
//     sums (n, nh) are per group too, and the combine adds each group's -2^-F n to its channels (before
//     combine_warps).
//   - the query arrives rotated (RT: a float32 [B, Hq, D] query from decode.rotate_query when rotate = 1): rotating
//     it here costs each CTA a read of the whole 128 KB R^T.
//   - registers: 2 CTAs per SM (255 registers); the key MMAs' query fragments live in shared memory (s_qb, loaded
//     beside each MMA); a window tile's values are loaded in window_tile, half the slices at a time.  STEP16: warps take 16-token steps (one sub-tile, loads one sub-tile ahead; the
//     host sets it at D = 256: 32-token steps spill and were not faster, int2_cuda.step16).
//   - shared memory: the prologue's arrays (query fragments, query, its bfloat16 parts, page ids) overlay the warps'
//     outputs s_acc, written after a barrier once every warp is done with them (60 KB would pass the 48 KB limit).
//   - the loops that gave each thread one channel (query scaling, output) take D / NT rounds.
// BF16 window sub-tiles use the same fragments with bfloat16 MMAs (the query as hi + lo bfloat16 parts, ~16
// bits like the float32 reference) and add into the same accumulator rows, their values times 4^s.
// ROPE_R > 0 (keys centered per position, rope.py): every logit also gets q . RoPE_p(mu_pre) =
// sum_j a_j cos(p t_j) + b_j sin(p t_j) over the R kept pairs j; see rope_terms.
// SPLIT_M > 0 (split keys, kernels/split_keys.py; D <= 128, keys at KBITS = 2, 3 or 4): the first SPLIT_M channels
// (all in slice 0, or slices 0 and 1 at m = D/2) are stored at SPLIT_HB bits with their own scale and zero point.  A
// key page is a plain KBITS page (the loads above stay as they are) followed by the P rows' tails of KTAIL bytes
// (the first part's float16 scale, uint8 zero point, then E = SPLIT_HB - KBITS planes of m/8 bytes: plane p, byte j,
// bit k is bit p of channel j + k m/8's upper code).  A logit is then s_lo (c_lo + z_lo qz_lo) + s_hi (c_hi + z_hi
// qz_hi):
//   c_lo  the usual key MMAs with the query masked to channels >= m (Query.qb);
//   c_hi  the s = 0 MMAs' A operands times the query masked to channels < m (Query.qh: the low KBITS bits; one more
//         MMA each; pairing two MMAs' slice 0 halves in one at m <= D/4 timed the same), plus one MMA per 16 first-part
//         channels whose A operand is the upper code << KBITS, as float16 1024 + u 2^KBITS (<= 1024 + 255, exact),
//         and whose k order follows the planes: thread t of MMA hh takes plane byte b = 2 hh + t / 2, bits 4 (t % 2)
//         .. + 3, i.e. channels b + (4 (t % 2) + i) m/8 (Query.qu lists the same channels).  With E <= 2 planes
//         (SPLIT_SLICED) one MMA per plane instead: the A entries are the plane byte masked in place (1024 + 2^pos
//         x bit, pos = 4 (t % 2) + i <= 7) and the B entries the query entries times 2^(KBITS + p - pos); fewer
//         instructions than assembling the codes (run SP1: 1-9% off the call).
// The tails of a 16-token sub-tile are 16 KTAIL contiguous bytes, 16-byte aligned; a warp copies them into shared
// memory with cp.async one step ahead (load_tails; no registers held in flight) and each thread reads its tokens'
// bytes there.  The buffers overlay the warp's own s_acc rows, which it writes only after its last step.
#define NT (NWARPS * 32)
#ifndef KBITS
#define KBITS 2
#endif
#ifndef VBITS
#define VBITS 2
#endif
#ifndef QGROUPS
#define QGROUPS 1
#endif
#ifndef SLIDING
#define SLIDING 0
#endif
#ifndef NG
#define NG 1
#endif
#ifndef STEP16
#define STEP16 0
#endif
#ifndef SPLIT_M
#define SPLIT_M 0
#endif
#define EARLY_LOADS (!SPLIT_M && (D != 128 || MIN_BLOCKS < 3))  // the first history loads before the rotation
#define KROW (D * KBITS / 8)  // key code bytes of a token row (split keys: its plain part)
#define VROW (D * VBITS / 8)  // value code bytes of a token row
// keys addressed with their own strides (stride_kcp, stride_kch)
#define KV_STRIDES (KBITS != 2 || VBITS != 2 || SPLIT_M)
#define D4 (D / 4)
#define KSTEPS (D / 16)
// A thread's share of a 16-token sub-tile: KB key code bytes of a token row (4 threads per row), VB value code
// bytes (8 row groups g), and, in the query rotation, RQ rows of R^T per warp in MT m16 tiles.
#define KB (D / 16)
#define KW (KB / 4)
#define VB (D4 / 8)
#define RQ (D / NWARPS)
#define MT (RQ / 16)
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef unsigned short u16;

// Scalar conversions between float32 and the 16-bit formats (round to nearest even).
__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float((u32)x << 16); }
__device__ __forceinline__ float f16_to_f32(u16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
__device__ __forceinline__ u16 f32_to_bf16(float x) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ u16 f32_to_f16(float x) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// The query's and the output's element types (0 float32, 1 bfloat16, 2 float16)
#if Q_KIND == 0
typedef float q_t;
__device__ __forceinline__ float q_float(float x) { return x; }
#else
typedef u16 q_t;
__device__ __forceinline__ float q_float(u16 x) { return Q_KIND == 1 ? bf16_to_f32(x) : f16_to_f32(x); }
#endif
#if O_KIND == 0
typedef float o_t;
__device__ __forceinline__ float o_from(float x) { return x; }
#else
typedef u16 o_t;
__device__ __forceinline__ u16 o_from(float x) { return O_KIND == 1 ? f32_to_bf16(x) : f32_to_f16(x); }
#endif

static_assert(D == 64 || D == 128 || D == 256, "the CUDA INT2 kernel is written for head dim 64, 128 and 256");
static_assert(NG == 1 || (NG == 2 && D == 256), "one metadata group per head, or two at head dim 256 (G = 128)");
static_assert(!STEP16 || D == 256, "16-token steps are the head dim 256 variants' (their registers)");
static_assert(MT >= 1 && (D <= NT || D % NT == 0), "the query scaling and the output loop over whole channel rounds");
#if D == 256
typedef uint4 kcode_t;  // a thread's key code bytes of one token (16)
typedef uint2 vcode_t;  // its value code bytes of one token (8)
typedef uint4 wval_t;   // its bfloat16 window values of one token and slice (8)
#elif D == 128
typedef uint2 kcode_t;  // a thread's key code bytes of one token (8)
typedef u32 vcode_t;    // its value code bytes of one token (4)
typedef uint2 wval_t;   // its bfloat16 window values of one token and slice (4)
#else
typedef u32 kcode_t;
typedef u16 vcode_t;
typedef u32 wval_t;
#endif
// Metadata as loaded: float16 scales and uint8 zero points (quant.py: x_hat = s (c - z 2^-F)) of a thread's two
// tokens g and g + 8, which the pool keeps side by side (layout.metadata_slot): SubTile.km[0] holds both scales,
// km[1] both zero points.  The minimum -s z 2^-F is never formed: a logit is s (c - z 2^-F sum(q)) with -2^-F sum(q)
// made once per query (Query.qz), and the values' term sum(p s z) is scaled by -2^-F once, at the combine.
#if NG == 2
typedef uint2 meta_t;  // scales: (s_g,0 s_g,1), (s_g+8,0 s_g+8,1); zero points: x = z_g,0 | z_g,1 << 8 | z_g+8,0 << 16 ..
#else
typedef u32 meta_t;  // scales: s_g | s_g+8 << 16; zero points: z_g | z_g+8 << 8
#endif
// 2^-F: a zero point counts these units of the scale (quant.fraction_bits: 8 - bits below 8 bits, 1 at 8)
#define KFRAC (KBITS == 8 ? 1.f : 1.f / (float)(1 << (8 - KBITS)))
#define VFRAC (VBITS == 8 ? 1.f : 1.f / (float)(1 << (8 - VBITS)))
__device__ __forceinline__ u32 word(const uint4& x, int w) { return w == 0 ? x.x : w == 1 ? x.y : w == 2 ? x.z : x.w; }
__device__ __forceinline__ u32 word(const uint2& x, int w) { return w ? x.y : x.x; }  // w: a constant
__device__ __forceinline__ u32 word(u32 x, int) { return x; }
static_assert(KBITS == 2 || KBITS == 3 || KBITS == 4 || KBITS == 5 || KBITS == 8, "keys at 2, 3, 4, 5 or 8 bits");
static_assert(VBITS == 2 || VBITS == 3 || VBITS == 4, "values at 2, 3 or 4 bits");
static_assert(GQA >= 1 && GQA <= 8, "one n8 MMA column block holds at most 8 query heads");
static_assert(P % 16 == 0, "pages hold whole 16-token sub-tiles");
#if SPLIT_M
#define SPLIT_E (SPLIT_HB - KBITS)                    // upper bits of a first-part code
#define SPLIT_PB (SPLIT_M / 8)                         // bytes of one plane of them
#define SPLIT_NH (SPLIT_M >= 16 ? SPLIT_M / 16 : 1)   // upper-bit MMAs per sub-tile
#define SPLIT_S1 (SPLIT_M > D4)                        // the first part reaches slice 1 (m = D/2)
#define SPLIT_SLICED (SPLIT_E <= 2)                    // upper bits as one MMA per plane (step)
#define SPLIT_QU (SPLIT_SLICED ? SPLIT_E : 1)          // B fragment sets of the upper-bit MMAs
#define HFRAC (SPLIT_HB == 8 ? 1.f : 1.f / (float)(1 << (8 - SPLIT_HB)))  // the first part's 2^-F
static_assert(D <= 128 && NG == 1 && (KBITS == 2 || KBITS == 3 || KBITS == 4), "split keys: D <= 128, KBITS 2-4");
static_assert(SPLIT_M >= 8 && SPLIT_M <= D / 2 && (SPLIT_M & (SPLIT_M - 1)) == 0, "split keys: m = 8 .. D/2, 2^k");
static_assert(SPLIT_E >= 1 && SPLIT_HB <= 8, "split keys: the first part 1 .. 8 - KBITS bits wider, at most 8");
static_assert(KTAIL == 3 + SPLIT_E * SPLIT_PB, "split keys: a tail is the scale, the zero point and E planes");
static_assert(4 * 16 * KTAIL <= 8 * D * 4, "split keys: a warp's four tail buffers fit its s_acc rows");
#define HZFRAC HFRAC
#else
#define HZFRAC KFRAC
#endif

// (x & (3 << 2s)) | magic in both halves, magic = 0x64006400 held in a register: the mask is LOP3's one
// immediate.  (With both constants as literals ptxas re-creates the mask in a register before every LOP3.)
__device__ __forceinline__ u32 code_half2(u32 x, int slice, u32 magic) {
  const u32 mask = (3u << (2 * slice)) * 0x00010001u;
  return (x & mask) | magic;
}

// A wide key's float16 pair 1024 + c * 4^s for slice s (KBITS 3 or 4; see the top of the file), both halves:
//   INT3  x: INT2-plane bytes (codes' low bits at 2s, 2s + 1), e: high bits already at 2s + 2
//   INT4  x: bytes j < D/4 (slice 0 nibble at bits 0-3, slice 2 at 4-7), e: bytes D/4 + j shifted up by 2 (slice 1
//         at 2-5, slice 3 at 6-9)
// c * 4^s < 1024 sits below the exponent bits of 0x6400, so OR-ing is adding.
__device__ __forceinline__ u32 key_a(u32 x, u32 e, int slice, u32 magic) {
#if KBITS == 3
  return (x & ((3u << (2 * slice)) * 0x00010001u)) | (e & ((4u << (2 * slice)) * 0x00010001u)) | magic;
#else
  return ((slice & 1 ? e : x) & ((15u << (2 * slice)) * 0x00010001u)) | magic;
#endif
}

// log2 of the factor a key code of slice s carries in its float16 1024 + c * 2^key_shift(s) (see the top of the file):
// 2s up to 4 bits, 0 at 8 (the bytes go under the exponent as they are), 0, 1, 4, 5 at 5 bits.  The query slice is
// divided by the same factor.
__device__ __forceinline__ int key_shift(int s) {
  return KBITS == 8 ? 0 : KBITS == 5 ? (s & 1) + 4 * (s >> 1) : 2 * s;
}

#if KBITS == 5
// An INT5 key's float16 pair 1024 + c * 2^key_shift(s), both halves: x the INT4 plane's bytes j < D/4 (slice 0's low
// nibble at bits 0-3, slice 2's at 4-7), e its bytes D/4 + j shifted up by 1 (slice 1's at 1-4, slice 3's at 5-8),
// ha / hb the high-bit plane's bytes with the high bits of slices 0, 2 at bits 4, 8 / of slices 1, 3 at 5, 9.
__device__ __forceinline__ u32 key_a5(u32 x, u32 e, u32 ha, u32 hb, int slice, u32 magic) {
  const int pos = key_shift(slice);
  return ((slice & 1 ? e : x) & ((15u << pos) * 0x00010001u)) | ((slice & 1 ? hb : ha) & ((16u << pos) * 0x00010001u)) |
         magic;
}
#endif

// An INT8 key's float16 pair 1024 + c for bytes hp and hp + 2 of x: the bytes under magic's 0x64 (byte 5 of the
// pair x, magic), one PRMT per two codes.
__device__ __forceinline__ u32 key_byte_pair(u32 x, int hp, u32 magic) {
  return __byte_perm(x, magic, hp ? 0x5351u : 0x5250u);
}

#if VBITS == 3
// An INT3 value's code bits for the slices of one parity, in place in both halves: x the INT2-plane bytes (low bits
// at 2s, 2s + 1), e the high-plane bytes shifted so that slice s's high bit is at 2s + 2.  Bits 2s, 2s + 1 of the
// parity's slices come from x, the others from e; value_a keeps slice s's three.
__device__ __forceinline__ u32 value_bits3(u32 x, u32 e, int parity) {
  const u32 from_x = (parity ? 0xccu : 0x33u) * 0x00010001u;
  return (x & from_x) | (e & ~from_x);
}
#endif

#if VBITS != 2
// A wide value's float16 pair 1024 + c * 4^s for slice s, both halves (see the top of the file):
//   INT3  lo, hi: value_bits3 of slices 0, 2 and of slices 1, 3
//   INT4  lo: bytes VB g + by (slice 0 nibble at bits 0-3, slice 2 at 4-7), hi: bytes D/4 + VB g + by shifted up by 2
//         (slice 1 at 2-5, slice 3 at 6-9)
__device__ __forceinline__ u32 value_a(u32 lo, u32 hi, int slice, u32 magic) {
  return ((slice & 1 ? hi : lo) & (((VBITS == 3 ? 7u : 15u) << (2 * slice)) * 0x00010001u)) | magic;
}
#endif

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, const float* c) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, const float* c) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Both bfloat16 halves times 4^s (exact: a power of two), as fma(x, 4^s, -0).
__device__ __forceinline__ u32 bf16x2_times_4pow(u32 x, int s) {
  if (s == 0) return x;
  const u32 f = (0x3f80u + 0x100u * s) * 0x00010001u;  // bfloat16 4^s in both halves
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(f), "r"(0x80008000u));
  return r;
}

// Both float16 halves of a word as floats (x = low: scale, y = high: minimum for a metadata word).
__device__ __forceinline__ float2 halves(u32 x) {
  float2 f;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}" : "=f"(f.x), "=f"(f.y) : "r"(x));
  return f;
}

// Byte b (a constant) of x as a float: under the exponent of 2^23 it is 2^23 + x_b exactly, and one FADD takes
// 2^23 away (a PRMT and an FADD instead of a shift, a mask and the quarter-rate integer conversion).
__device__ __forceinline__ float byte_float(u32 x, int b) {
  return __uint_as_float(__byte_perm(x, 0x4b000000u, 0x7540u + b)) - 8388608.f;
}
#if NG == 1
// Scales and zero points of tokens g (.x) and g + 8 (.y), one group a token (NG = 1).
__device__ __forceinline__ void scale_zero(const meta_t (&m)[2], float2& sc, float2& z) {
  sc = halves(m[0]);
  z = make_float2(byte_float(m[1], 0), byte_float(m[1], 1));
}
#else
// Token u (0: g, 1: g + 8)'s (scale_0, scale_1) and (zero_0, zero_1), two groups a token (NG = 2).
__device__ __forceinline__ void scale_zero2(const uint2 (&m)[2], int u, float2& sc, float2& z) {
  sc = halves(u ? m[0].y : m[0].x);
  z = make_float2(byte_float(m[1].x, 2 * u), byte_float(m[1].x, 2 * u + 1));
}
#endif

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float lg2(float x) {
  float r;
  asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float warp_max_rows(float x) {  // over the 8 lanes of one column (lane % 4)
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

// ---- timing stamps (compiled in with STAMPS=1 only: benchmarks/cuda_int2_sweep.py --stamps)
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#if STAMPS
#define STAMP(k) \
  if (threadIdx.x == 0) TS[(((long long)b * gridDim.y + y) * splits + split) * 16 + (k)] = global_ns()
// after this warp's 1st, 2nd, 4th, 8th, 16th and 64th INT2 step: slots 10-15
#define STEP_STAMP(n) \
  if (++(n) == 1 || (n) == 2 || (n) == 4 || (n) == 8 || (n) == 16 || (n) == 64) \
    STAMP((n) == 64 ? 15 : 10 + __ffs(n) - 1)
#else
#define STAMP(k)
#define STEP_STAMP(n)
#endif

__device__ __forceinline__ float warp_max_all(float x) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum_all(float x) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The sum over the 4 lanes of a row (lane / 4) of the query fragments' per-thread partial sums.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Rows 2t and 2t + 1 of a row sum (lanes 8t and 8t + 4), times f: the values of this thread's heads 2t, 2t + 1.
__device__ __forceinline__ void head_pair(float x, int t, float f, float& h0, float& h1) {
  h0 = f * __shfl_sync(0xffffffffu, x, 8 * t);
  h1 = f * __shfl_sync(0xffffffffu, x, 8 * t + 4);
}

__device__ __forceinline__ float warp_sum_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}


// What one thread loads for one 16-token sub-tile.
struct SubTile {
  kcode_t k[2];  // key code bytes KB t .. KB t + KB - 1 of tokens g and g+8
#if KBITS == 8
  kcode_t ks[3][2];  // INT8: bytes D/4 s + KB t .. of slices s = 1, 2, 3 (k holds slice 0), tokens g, g+8
#elif KBITS != 2
  kcode_t kx[2];  // INT3: high-bit plane bytes D/4 + KB (t & 1) ..; INT4, INT5: bytes D/4 + KB t .. (tokens g, g+8)
#endif
#if KBITS == 5
  kcode_t kh[2];  // INT5: high-bit plane bytes D/2 + KB (t & 1) .. (tokens g, g+8)
#endif
#if D > 128
  vcode_t v[4];  // value code bytes VB g .. VB g + VB - 1 of tokens 2t, 2t+1, 2t+8, 2t+9
#if VBITS != 2
  vcode_t vx[4];  // INT3: high-bit plane bytes D/4 + VB (g & 3) ..; INT4: bytes D/4 + VB g .. (the same tokens)
#endif
#else
  u32 v[4];      // value code bytes VB g .. VB g + VB - 1 of tokens 2t, 2t+1, 2t+8, 2t+9
#if VBITS != 2
  u32 vx[4];     // INT3: high-bit plane bytes D/4 + VB (g & 3) ..; INT4: bytes D/4 + VB g .. (the same tokens)
#endif
#endif
  meta_t km[2];  // key scales, then zero points, of tokens g and g+8 (meta_t)
  meta_t vm[2];  // value scales, then zero points, of tokens g and g+8
};

// This thread's view of one (sequence, KV head): pointers with its own lane offsets folded in.
struct Source {
  const unsigned char* k;  // + g*KROW + KB t
#if KBITS != 2
  const unsigned char* kx;  // + g*KROW + the thread's second key bytes (SubTile.kx)
#endif
#if KBITS == 5
  const unsigned char* kh;  // + g*KROW + its high-bit plane bytes (SubTile.kh)
#endif
#if KV_STRIDES
  unsigned long long kcp;   // key page stride (code bytes)
#endif
#if SPLIT_M
  const unsigned char* kt;  // the KV head's first page's tails (its P plain rows on): no lane offset
#endif
  const unsigned char* v;  // + 2t*VROW + VB g
#if VBITS != 2
  const unsigned char* vx;  // + 2t*VROW + the thread's second value bytes (SubTile.vx)
#endif
  const u16* ks;           // scales + 2g NG (layout.metadata_slot)
  const unsigned char* kz;  // zero points + 2g NG (the same element offsets as the scales)
  const u16* vs;
  const unsigned char* vz;
  const int* pages;        // the CTA's page ids, in shared memory
  unsigned long long cp, mp;  // page strides: code bytes, metadata elements (scales and zero points alike)
  int first;               // token index of pages[0]
  unsigned long long policy;  // L2 eviction policy of the code loads (stream_policy)
};

// Read-only loads that have L2 fetch the whole 256-byte block around the address: a sub-tile's 512 code bytes
// arrive in two DRAM requests instead of one per 32-byte sector the warp touches (the V loads touch every other
// row).  -2% at batch >= 8, within noise at batch 1 (benchmarks/NOTES.md, "loads with the L2::256B fetch hint").
__device__ __forceinline__ u32 ldg_l2_256(const u32* p) {
  u32 r;
  asm("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
// The code bytes are read once per call by one CTA.  With evict_first their L2 lines go first when L2 needs room,
// so the stream does not push out what L2 holds (dirty lines would first be written back).  That pays while a
// call reads up to about twice the L2 (at most an L2 of lines to keep); longer streams lose more reuse of the
// 256-byte blocks than they save, so the host picks (int2_cuda.STREAM_EVICT_FIRST_L2S).  The metadata keeps the
// normal priority: four KV heads' CTAs share each 256-byte block of it.  benchmarks/NOTES.md, "the flush leaves
// dirty lines; evict_first" and "evict_first chosen per call".
__device__ __forceinline__ unsigned long long stream_policy(int evict_first) {
  unsigned long long first, normal;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
  return evict_first ? first : normal;
}
__device__ __forceinline__ u32 ldg_l2_256(const u16* p) {
  u16 r;
  asm("ld.global.nc.L2::256B.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 ldg_l2_256(const unsigned char* p) {
  u32 r;
  asm("ld.global.nc.L2::256B.u8 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ldg_l2_256(const uint2* p) {
  uint2 r;
  asm("ld.global.nc.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ldg_stream(const uint4* p, unsigned long long policy) {
  uint4 r;
  asm("ld.global.nc.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(policy));
  return r;
}
__device__ __forceinline__ uint2 ldg_stream(const uint2* p, unsigned long long policy) {
  uint2 r;
  asm("ld.global.nc.L2::cache_hint.L2::256B.v2.u32 {%0, %1}, [%2], %3;" : "=r"(r.x), "=r"(r.y) : "l"(p), "l"(policy));
  return r;
}
__device__ __forceinline__ u32 ldg_stream(const u32* p, unsigned long long policy) {
  u32 r;
  asm("ld.global.nc.L2::cache_hint.L2::256B.u32 %0, [%1], %2;" : "=r"(r) : "l"(p), "l"(policy));
  return r;
}
__device__ __forceinline__ u32 ldg_stream(const u16* p, unsigned long long policy) {
  u16 r;
  asm("ld.global.nc.L2::cache_hint.L2::256B.u16 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(policy));
  return r;
}
// The scales and zero points of tokens g and g + 8 (side by side in the pool): one load each.  Several KV heads'
// CTAs share each 256-byte block of them.
__device__ __forceinline__ void load_meta(meta_t (&m)[2], const u16* scale, const unsigned char* zero) {
#if NG == 2
  m[0] = ldg_l2_256(reinterpret_cast<const uint2*>(scale));
  m[1] = make_uint2(ldg_l2_256(reinterpret_cast<const u32*>(zero)), 0u);
#else
  m[0] = ldg_l2_256(reinterpret_cast<const u32*>(scale));
  m[1] = ldg_l2_256(reinterpret_cast<const u16*>(zero));
#endif
}
__device__ __forceinline__ void load_sub_tile(SubTile& st, const Source& src, int pos) {
  const unsigned rel = (unsigned)(pos - src.first);
  const unsigned phys = (unsigned)src.pages[rel / P], off = rel % P;
  const unsigned long long oc = (unsigned long long)phys * src.cp + off * VROW;
  const unsigned long long om = (unsigned long long)phys * src.mp + off * NG;
  const unsigned long long pol = src.policy;
#if !KV_STRIDES
  st.k[0] = ldg_stream(reinterpret_cast<const kcode_t*>(src.k + oc), pol);
  st.k[1] = ldg_stream(reinterpret_cast<const kcode_t*>(src.k + oc + 8 * D4), pol);
#else
  const unsigned long long ok = (unsigned long long)phys * src.kcp + off * KROW;
  st.k[0] = ldg_stream(reinterpret_cast<const kcode_t*>(src.k + ok), pol);
  st.k[1] = ldg_stream(reinterpret_cast<const kcode_t*>(src.k + ok + 8 * KROW), pol);
#if KBITS == 8
#pragma unroll
  for (int s = 1; s < 4; ++s) {
    st.ks[s - 1][0] = ldg_stream(reinterpret_cast<const kcode_t*>(src.k + ok + D4 * s), pol);
    st.ks[s - 1][1] = ldg_stream(reinterpret_cast<const kcode_t*>(src.k + ok + D4 * s + 8 * KROW), pol);
  }
#elif KBITS != 2
  st.kx[0] = ldg_stream(reinterpret_cast<const kcode_t*>(src.kx + ok), pol);
  st.kx[1] = ldg_stream(reinterpret_cast<const kcode_t*>(src.kx + ok + 8 * KROW), pol);
#endif
#if KBITS == 5
  st.kh[0] = ldg_stream(reinterpret_cast<const kcode_t*>(src.kh + ok), pol);
  st.kh[1] = ldg_stream(reinterpret_cast<const kcode_t*>(src.kh + ok + 8 * KROW), pol);
#endif
#endif
  st.v[0] = ldg_stream(reinterpret_cast<const vcode_t*>(src.v + oc), pol);
  st.v[1] = ldg_stream(reinterpret_cast<const vcode_t*>(src.v + oc + VROW), pol);
  st.v[2] = ldg_stream(reinterpret_cast<const vcode_t*>(src.v + oc + 8 * VROW), pol);
  st.v[3] = ldg_stream(reinterpret_cast<const vcode_t*>(src.v + oc + 9 * VROW), pol);
#if VBITS != 2
  st.vx[0] = ldg_stream(reinterpret_cast<const vcode_t*>(src.vx + oc), pol);
  st.vx[1] = ldg_stream(reinterpret_cast<const vcode_t*>(src.vx + oc + VROW), pol);
  st.vx[2] = ldg_stream(reinterpret_cast<const vcode_t*>(src.vx + oc + 8 * VROW), pol);
  st.vx[3] = ldg_stream(reinterpret_cast<const vcode_t*>(src.vx + oc + 9 * VROW), pol);
#endif
  load_meta(st.km, src.ks + om, src.kz + om);
  load_meta(st.vm, src.vs + om, src.vz + om);
}

#if SPLIT_M
__device__ __forceinline__ u32 shared_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// The warp copies the 16 tails of the sub-tile at pos (16 KTAIL bytes, 16-byte aligned) to dst, 16 bytes a lane.
__device__ __forceinline__ void load_tails(unsigned char* dst, const Source& src, int pos) {
  const unsigned rel = (unsigned)(pos - src.first);
  const unsigned phys = (unsigned)src.pages[rel / P], off = rel % P;
  const unsigned char* from = src.kt + (unsigned long long)phys * src.kcp + off * KTAIL;
#pragma unroll
  for (int c = threadIdx.x & 31; c < KTAIL; c += 32)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_addr(dst + 16 * c)), "l"(from + 16 * c)
                 : "memory");
}
__device__ __forceinline__ void tails_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most N of the warp's copies are in flight, then let every lane see the others' bytes.
template <int N>
__device__ __forceinline__ void tails_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
  __syncwarp();
}
#endif

// One warp's running state: O^T fragments (block i: rows = channel combos 2i, 2i+1; cols = heads 2t, 2t+1),
// running max m, and this thread's partial sums of p (l) and of p * scale_v * zero_v (n: -2^-F n is the minimum's
// share of the output, applied at the combine), per column.
// NG = 2 (D = 256, G = 128): blocks of even i hold slices 0 and 1 (channels < 128, group 0), odd i slices 2 and 3
// (group 1); pend and n are group 0's, pend_hi and nh group 1's.
struct State {
  float acc[KSTEPS][4];
  float pend[4];  // 1024 * sum(PP) the value MMAs added to acc and that is not yet subtracted (C layout)
#if NG == 2
  float pend_hi[4];
#endif
  float m0, m1, l0, l1, n0, n1;
#if NG == 2
  float nh0, nh1;
#endif
  int since_flush;
};
#if NG == 2
#define PEND(i) ((i) & 1 ? st.pend_hi : st.pend)  // the pending offset of accumulator block i (a constant)
#else
#define PEND(i) st.pend
#endif

#define FLUSH_STEPS 8

__device__ __forceinline__ void flush_offset(State& st) {
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    st.acc[i][0] -= PEND(i)[0];
    st.acc[i][1] -= PEND(i)[1];
    st.acc[i][2] -= PEND(i)[2];
    st.acc[i][3] -= PEND(i)[3];
  }
  st.pend[0] = st.pend[1] = st.pend[2] = st.pend[3] = 0.f;
#if NG == 2
  st.pend_hi[0] = st.pend_hi[1] = st.pend_hi[2] = st.pend_hi[3] = 0.f;
#endif
  st.since_flush = 0;
}

// The running max to take exponents against: a sliding-window warp may have seen only masked tokens (m = -inf),
// whose exponents must come out 0, not ex2(-inf + inf).
__device__ __forceinline__ float safe_max(float m) {
#if SLIDING
  return m == NEG_INF ? 0.f : m;
#else
  return m;
#endif
}

// Online softmax, lazy: the reference max m of a column moves (and acc, l, n are rescaled, the pending offset
// leaving acc on the way) only when a logit exceeds it somewhere in the warp.  mx0 / mx1: the maxima of this
// thread's own logits of the step (its rows; heads 2t, 2t + 1).  The vote needs no reduction over the column's
// lanes; that reduction (three dependent shuffle rounds) runs only when the max moves, rarely after the first steps:
// 2-3.5% off the history loop at batch 8 and 32 (benchmarks/NOTES.md, "the warp-wide max only when it moves").
// Returns whether it rescaled.
__device__ __forceinline__ bool raise_max(State& st, float mx0, float mx1) {
  if (!__any_sync(0xffffffffu, mx0 > st.m0 || mx1 > st.m1)) return false;
  mx0 = warp_max_rows(mx0);
  mx1 = warp_max_rows(mx1);
  const float mn0 = fmaxf(st.m0, mx0), mn1 = fmaxf(st.m1, mx1);
  const float al0 = ex2(st.m0 - mn0), al1 = ex2(st.m1 - mn1);
  st.m0 = mn0;
  st.m1 = mn1;
  st.l0 *= al0;
  st.l1 *= al1;
  st.n0 *= al0;
  st.n1 *= al1;
  const float p0 = st.pend[0] * al0, p1 = st.pend[1] * al1;
#if NG == 2
  st.nh0 *= al0;
  st.nh1 *= al1;
  const float ph0 = st.pend_hi[0] * al0, ph1 = st.pend_hi[1] * al1;
#define PEND0(i) ((i) & 1 ? ph0 : p0)
#define PEND1(i) ((i) & 1 ? ph1 : p1)
#else
#define PEND0(i) p0
#define PEND1(i) p1
#endif
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {  // acc <- (acc - pending offset) * alpha
    st.acc[i][0] = st.acc[i][0] * al0 - PEND0(i);
    st.acc[i][1] = st.acc[i][1] * al1 - PEND1(i);
    st.acc[i][2] = st.acc[i][2] * al0 - PEND0(i);
    st.acc[i][3] = st.acc[i][3] * al1 - PEND1(i);
  }
#undef PEND0
#undef PEND1
  st.pend[0] = st.pend[1] = st.pend[2] = st.pend[3] = 0.f;
#if NG == 2
  st.pend_hi[0] = st.pend_hi[1] = st.pend_hi[2] = st.pend_hi[3] = 0.f;
#endif
  st.since_flush = 0;
  return true;
}

// ---------------------------------------------------------------------------------- position-aware term
// For the 16 keys at p0 + v (p0 a multiple of 16, v < 16, or v < 32 for the two sub-tiles of a step):
//   a cos((p0+v)t) + b sin((p0+v)t) = W_re cos(vt) - W_im sin(vt),  W = (a - ib) e^{i p0 t}
// W (per head and pair) is turned by the phase at p0 in float32, from a table of (cos, sin) at multiples of
// 16 positions (PH, the same float64-angle numbers the write side subtracted, times the RoPE scaling); then
// one m16n8k16 MMA per 8 pairs sums over pairs and v against the constant in-tile table A[v, 2j + c] =
// (cos vt_j, -sin vt_j) of this KV head's pairs, kept in shared memory as float16 fragments.  Both operands
// are float16 hi + lo parts and three MMAs take hi.hi + hi.lo + lo.hi (~22 bits): with |mu_pre| near 900 (a
// k_proj bias) the term is hundreds of logit units and one float16 rounding would cost ~0.1 of them.
#if ROPE_R
#define RK (ROPE_R / 8)  // MMA k-steps of the term (8 pairs each)
static_assert(ROPE_R % 8 == 0 && ROPE_R <= 32, "the CUDA kernel visits 8 .. 32 pairs, a multiple of 8");
__shared__ __align__(16) float4 s_rab[8][4][RK];     // head g, t, kk: (a, b) of pairs 8kk + t, 8kk + t + 4
__shared__ __align__(16) uint4 s_rta[2][RK][32][2];  // sub-tile u, kk, lane: A fragments (hi, lo), rows 16u + v
__shared__ __align__(16) float2 s_rph[NWARPS][ROPE_R];  // per warp: the phases of the R pairs (window tiles)

// The two channels of pair j (rope.RotaryLayout.channels): the rotated pairs j < ROPE_ROT / 2 are (j, j + ROPE_ROT / 2)
// (rotate-half) or (2j, 2j + 1) (ROPE_INTERLEAVED); the pass-through pairs past them (j + ROPE_ROT / 2, j + D / 2).
// RoPE over the whole head (ROPE_ROT = D, rotate-half) gives (j, j + D / 2).
__device__ __forceinline__ int pair_lo(int j) {
  return j < ROPE_ROT / 2 ? (ROPE_INTERLEAVED ? 2 * j : j) : j + ROPE_ROT / 2;
}
__device__ __forceinline__ int pair_hi(int j) {
  return j < ROPE_ROT / 2 ? (ROPE_INTERLEAVED ? 2 * j + 1 : j + ROPE_ROT / 2) : j + D / 2;
}

// Fill the shared tables (all threads; a __syncthreads must follow).  q: the unrotated query rows in shared
// memory; MU [D] mu_pre of this KV head; PRh [R] its pairs; TL [32][D/2] (cos, sin) of v t_i.
__device__ void rope_prologue(const float (*q)[D], const float* __restrict__ MU, const int* __restrict__ PRh,
                              const float2* __restrict__ TL, float scale) {
  for (int i = threadIdx.x; i < 8 * 4 * RK; i += NT) {
    const int hh = i / (4 * RK), tt = (i / RK) % 4, kk = i % RK;
    float v[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int pr = PRh[8 * kk + tt + 4 * e], c0 = pair_lo(pr), c1 = pair_hi(pr);
      const float m0 = MU[c0], m1 = MU[c1], q0 = q[hh][c0], q1 = q[hh][c1];
      v[2 * e] = (q0 * m0 + q1 * m1) * scale;
      v[2 * e + 1] = (q1 * m0 - q0 * m1) * scale;
    }
    s_rab[hh][tt][kk] = make_float4(v[0], v[1], v[2], v[3]);
  }
  for (int i = threadIdx.x; i < 2 * RK * 32; i += NT) {
    const int u = i / (RK * 32), kk = (i / 32) % RK, ln = i % 32, gg = ln >> 2, tt = ln & 3;
    u32 hi[4], lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // reg r: row gg (+8 for odd r), pair 8kk + tt (+4 for r >= 2)
      const float2 cs = TL[(16 * u + gg + 8 * (r & 1)) * (D / 2) + PRh[8 * kk + tt + 4 * (r >> 1)]];
      hi[r] = pack_half2(cs.x, -cs.y);
      const float2 h = halves(hi[r]);
      lo[r] = pack_half2(cs.x - h.x, -cs.y - h.y);
    }
    s_rta[u][kk][ln][0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    s_rta[u][kk][ln][1] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
}

// The phase (cos, sin) at p0 (a multiple of 16) of this lane's pair ``pair`` = PR[lane] for lanes < R, zeros
// for the others.  The INT2 loop reads it one step ahead into registers and hands it to the lanes by shuffles:
// staging through shared memory (cp.async, wait, warp barriers) costs 7-18% of the step (benchmarks/NOTES.md,
// "where the 1.1-1.9x goes").
__device__ __forceinline__ float2 rope_phase(const float2* __restrict__ PH, int p0, int pair, bool go) {
  return go && (threadIdx.x & 31) < ROPE_R ? __ldg(PH + (long long)(p0 >> 4) * (D / 2) + pair)
                                           : make_float2(0.f, 0.f);
}

// sc[u] (C layout: keys 16u + g, 16u + g + 8 x heads 2t, 2t + 1) += the term of k-step kk (pairs 8kk + t and
// 8kk + t + 4, phases c0 and c1 at p0) for keys p0 + 16u + v, u < NSUB.
template <int NSUB>
__device__ __forceinline__ void rope_kstep(float (*sc)[4], int kk, float2 c0, float2 c1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float4 ab = s_rab[g][t][kk];
  const float re0 = ab.x * c0.x + ab.y * c0.y, im0 = ab.x * c0.y - ab.y * c0.x;
  const float re1 = ab.z * c1.x + ab.w * c1.y, im1 = ab.z * c1.y - ab.w * c1.x;
  const u32 bh0 = pack_half2(re0, im0), bh1 = pack_half2(re1, im1);
  const float2 h0 = halves(bh0), h1 = halves(bh1);
  const u32 bl0 = pack_half2(re0 - h0.x, im0 - h0.y), bl1 = pack_half2(re1 - h1.x, im1 - h1.y);
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
    const uint4 ah = s_rta[u][kk][lane][0], al = s_rta[u][kk][lane][1];
    mma(sc[u], ah.x, ah.y, ah.z, ah.w, bh0, bh1, sc[u]);
    mma(sc[u], ah.x, ah.y, ah.z, ah.w, bl0, bl1, sc[u]);
    mma(sc[u], al.x, al.y, al.z, al.w, bh0, bh1, sc[u]);
  }
}

// The term for the keys of an INT2 step at p0; ``ph``: rope_phase(p0) of this lane.
// The k-steps are not unrolled: unrolled, ptxas hoists every k-step's operands and spills ~900 bytes.
template <int NSUB>
__device__ __forceinline__ void rope_terms(float (*sc)[4], float2 ph) {
  const int t = threadIdx.x & 3;
#pragma unroll 1
  for (int kk = 0; kk < RK; ++kk) {
    const int j0 = 8 * kk + t, j1 = j0 + 4;
    const float2 c0 = make_float2(__shfl_sync(0xffffffffu, ph.x, j0), __shfl_sync(0xffffffffu, ph.y, j0));
    const float2 c1 = make_float2(__shfl_sync(0xffffffffu, ph.x, j1), __shfl_sync(0xffffffffu, ph.y, j1));
    rope_kstep<NSUB>(sc, kk, c0, c1);
  }
}

// The term for one window sub-tile at p0 (once or twice per warp): its phases through this warp's shared row.
__device__ __forceinline__ void rope_terms_window(float (*sc)[4], const float2* __restrict__ PH, int p0, int pair) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  float2* row = s_rph[threadIdx.x >> 5];
  if (lane < ROPE_R) row[lane] = rope_phase(PH, p0, pair, true);
  __syncwarp();
#pragma unroll 1
  for (int kk = 0; kk < RK; ++kk) rope_kstep<1>(sc, kk, row[8 * kk + t], row[8 * kk + t + 4]);
  __syncwarp();  // every lane is done with the row before the next tile writes it
}
#endif

#if D > 128
// D = 256: the key MMAs' B fragments (32 registers) stay in shared memory, s_qb[i / 2][lane] = registers (i, i + 1)
// of the D <= 128 layout, read next to each MMA: in registers the INT2 loop spills (255 registers; KBITS 3, 4: ~300
// bytes a thread).  A volatile load, so that the compiler does not hoist the loads out of the loop again.
__device__ __forceinline__ uint2 ld_shared_u2(const uint2* p) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"((u32)__cvta_generic_to_shared(p)));
  return r;
}
#endif

struct Query {
#if D > 128
  const uint2* qb;     // &s_qb[0][lane]: pair i / 2 of the B fragments at qb[32 (i / 2)]
#else
  u32 qb[2 * KSTEPS];  // B fragments of the key MMAs
#endif
  float koff0, koff1;  // 1024 * sum of the float16 B entries, heads 2t and 2t+1
  float qz0, qz1;      // -2^-F * sum of the query, heads 2t and 2t+1: a logit is s c + s z qz
#if NG == 2 || SPLIT_M
  // the same over group 1 (slices 2, 3; koff / qz: group 0, slices 0, 1), or over a split row's first part (koff /
  // qz: the second's)
  float koffh0, koffh1, qzh0, qzh1;
#endif
#if SPLIT_M
  u32 qh[KSTEPS / 2];  // B fragments of the first part's MMAs over the s = 0 MMAs' codes: qb[4 k] masked to it
#if SPLIT_S1
  u32 qh1[KSTEPS / 2];  // and qb[4 k + 1] (slice 1), at m = D/2
#endif
  u32 qu[2 * SPLIT_NH * SPLIT_QU];  // B fragments of the upper-bit MMAs (the header's SPLIT_M paragraph; per plane
                                   // when SPLIT_SLICED)
#endif
  u32 magic;           // 0x64006400, opaque to ptxas (see code_half2)
};

// One 32-token step: two sub-tiles, one softmax update.  HALF: only the first sub-tile holds tokens.  skip
// (SLIDING): how many of the step's first tokens lie below the window.
// tl (split keys): the two sub-tiles' tails in shared memory (load_tails), 16 KTAIL bytes apart.
template <bool HALF>
__device__ __forceinline__ void step(State& st, const Query& q, const SubTile* cur, float2 rph, int skip,
                                     const unsigned char* tl) {
  const float kinit[4] = {-q.koff0, -q.koff1, -q.koff0, -q.koff1};
#if SPLIT_M
#if SPLIT_S1
#define QH1(k) q.qh1[k]
#else
#define QH1(k) 0u
#endif
  // c: the second part's logits; ch: the first part's, from the codes' low bits (the MMAs of s = 0, i = 4 k, again)
  // and the upper bits (after the loop)
  const float kinit_h[4] = {-q.koffh0, -q.koffh1, -q.koffh0, -q.koffh1};
#define KMMA(s, i, a0, a1, a2, a3) { \
  const u32 A0 = (a0), A1 = (a1), A2 = (a2), A3 = (a3); \
  mma(c, A0, A1, A2, A3, q.qb[i], q.qb[(i) + 1], (i) == 0 ? kinit : c); \
  if ((s) == 0) mma(ch, A0, A1, A2, A3, q.qh[(i) / 4], QH1((i) / 4), (i) == 0 ? kinit_h : ch); }
#elif D > 128 && NG == 2
  // two logit accumulators: c sums slices 0, 1 (group 0: the MMAs of s = 0), ch slices 2, 3 (group 1: s = 2)
  const float kinit_h[4] = {-q.koffh0, -q.koffh1, -q.koffh0, -q.koffh1};
#define KMMA(s, i, a0, a1, a2, a3) { \
  const uint2 qbi = ld_shared_u2(q.qb + 32 * ((i) / 2)); \
  if ((s) == 0) mma(c, a0, a1, a2, a3, qbi.x, qbi.y, (i) == 0 ? kinit : c); \
  else mma(ch, a0, a1, a2, a3, qbi.x, qbi.y, (i) == 2 ? kinit_h : ch); }
#elif D > 128
#define KMMA(s, i, a0, a1, a2, a3) { \
  const uint2 qbi = ld_shared_u2(q.qb + 32 * ((i) / 2)); \
  mma(c, a0, a1, a2, a3, qbi.x, qbi.y, (i) == 0 ? kinit : c); }
#else
#define KMMA(s, i, a0, a1, a2, a3) mma(c, a0, a1, a2, a3, q.qb[i], q.qb[(i) + 1], (i) == 0 ? kinit : c)
#endif
#if KBITS == 3 || KBITS == 4 || KBITS == 5
  const int par = (threadIdx.x >> 1) & 1;  // INT3: t >> 1, the bit of a high-bit plane byte that holds its channels
#endif
  float sc[2][4];  // logits: tokens (g, g, g+8, g+8) x heads (2t, 2t+1, 2t, 2t+1)
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    if (HALF && u == 1) {
      sc[1][0] = sc[1][1] = sc[1][2] = sc[1][3] = NEG_INF;
      continue;
    }
    float c[4];
#if NG == 2 || SPLIT_M
    float ch[4];
#endif
#pragma unroll
    for (int w = 0; w < KW; ++w)
#pragma unroll
      for (int hp = 0; hp < 2; ++hp) {
#if KBITS != 8
        const u32 x0 = word(cur[u].k[0], w), x1 = word(cur[u].k[1], w);
        const u32 r0 = hp ? x0 >> 8 : x0;
        const u32 r1 = hp ? x1 >> 8 : x1;
#endif
#if KBITS == 2
#pragma unroll
        for (int s = 0; s < 4; s += 2) {
          const int i = 8 * w + 4 * hp + s;  // registers i (k = 2t, 2t+1) and i + 1 (k = 2t+8, 2t+9)
          KMMA(s, i, code_half2(r0, s, q.magic), code_half2(r1, s, q.magic), code_half2(r0, s + 1, q.magic),
               code_half2(r1, s + 1, q.magic));
        }
#elif KBITS == 8
#pragma unroll
        for (int s = 0; s < 4; s += 2) {
          const int i = 8 * w + 4 * hp + s;
          const u32 y0 = word(s ? cur[u].ks[s - 1][0] : cur[u].k[0], w), y1 = word(s ? cur[u].ks[s - 1][1] : cur[u].k[1], w);
          const u32 z0 = word(cur[u].ks[s][0], w), z1 = word(cur[u].ks[s][1], w);
          KMMA(s, i, key_byte_pair(y0, hp, q.magic), key_byte_pair(y1, hp, q.magic), key_byte_pair(z0, hp, q.magic),
               key_byte_pair(z1, hp, q.magic));
        }
#elif KBITS == 5
        // the upper bytes hp, hp + 2 shifted up by 1; the high bits of bytes hp, hp + 2 (bit 2s + par) to bits 4, 8
        // (slices 0, 2: ha) and 5, 9 (slices 1, 3: hb) of the two halves (key_a5)
        const u32 y0 = word(cur[u].kx[0], w), y1 = word(cur[u].kx[1], w);
        const u32 e0 = hp ? y0 >> 7 : y0 << 1, e1 = hp ? y1 >> 7 : y1 << 1;
        const u32 h0 = hp ? word(cur[u].kh[0], w) >> 8 : word(cur[u].kh[0], w);
        const u32 h1 = hp ? word(cur[u].kh[1], w) >> 8 : word(cur[u].kh[1], w);
        const u32 ha0 = h0 << (4 - par), hb0 = h0 << (3 - par), ha1 = h1 << (4 - par), hb1 = h1 << (3 - par);
#pragma unroll
        for (int s = 0; s < 4; s += 2) {
          const int i = 8 * w + 4 * hp + s;
          KMMA(s, i, key_a5(r0, e0, ha0, hb0, s, q.magic), key_a5(r1, e1, ha1, hb1, s, q.magic),
               key_a5(r0, e0, ha0, hb0, s + 1, q.magic), key_a5(r1, e1, ha1, hb1, s + 1, q.magic));
        }
#else
        // INT3: the high bits of bytes hp, hp + 2 (bit 2s + par) to bits 2s + 2 of the two halves; INT4: the upper
        // bytes hp, hp + 2 shifted up by 2 (see key_a)
        const u32 y0 = word(cur[u].kx[0], w), y1 = word(cur[u].kx[1], w);
        const u32 e0 = KBITS == 3 ? (hp ? y0 >> (6 + par) : y0 << (2 - par)) : (hp ? y0 >> 6 : y0 << 2);
        const u32 e1 = KBITS == 3 ? (hp ? y1 >> (6 + par) : y1 << (2 - par)) : (hp ? y1 >> 6 : y1 << 2);
#pragma unroll
        for (int s = 0; s < 4; s += 2) {
          const int i = 8 * w + 4 * hp + s;
          KMMA(s, i, key_a(r0, e0, s, q.magic), key_a(r1, e1, s, q.magic), key_a(r0, e0, s + 1, q.magic),
               key_a(r1, e1, s + 1, q.magic));
        }
#endif
      }
#if NG == 2
    float2 ks0, kz0, ks1, kz1;  // (group 0, group 1) scales and zero points of token g (ks0, kz0) and g+8
    scale_zero2(cur[u].km, 0, ks0, kz0);
    scale_zero2(cur[u].km, 1, ks1, kz1);
    const float2 sz0 = make_float2(ks0.x * kz0.x, ks0.y * kz0.y), sz1 = make_float2(ks1.x * kz1.x, ks1.y * kz1.y);
    sc[u][0] = ks0.x * c[0] + ks0.y * ch[0] + (sz0.x * q.qz0 + sz0.y * q.qzh0);
    sc[u][1] = ks0.x * c[1] + ks0.y * ch[1] + (sz0.x * q.qz1 + sz0.y * q.qzh1);
    sc[u][2] = ks1.x * c[2] + ks1.y * ch[2] + (sz1.x * q.qz0 + sz1.y * q.qzh0);
    sc[u][3] = ks1.x * c[3] + ks1.y * ch[3] + (sz1.x * q.qz1 + sz1.y * q.qzh1);
#else
#if SPLIT_M
    // the first part's upper bits (one MMA per 16 of its channels), then its scale and zero point, from the tails
    const int lg = (threadIdx.x & 31) >> 2, lt = threadIdx.x & 3;
    const unsigned char* r0 = tl + 16 * KTAIL * u + KTAIL * lg;  // token g's tail
    const unsigned char* r1 = r0 + 8 * KTAIL;                    // token g + 8's
#if SPLIT_SLICED
    // one MMA per plane p: the A entry of channel b + (sh + i) m/8 is 1024 + 2^(sh + i) x its bit p, the plane byte
    // masked in place (both halves of a register from one copy of the byte in each half), and the B entry its query
    // entry times 2^(KBITS + p - sh - i): fewer instructions than assembling the codes for E <= 2 planes
    {
      const int sh = 4 * (lt & 1);
      const u32 m01 = 0x00020001u << sh, m23 = 0x00080004u << sh;  // bits sh, sh + 1 / sh + 2, sh + 3 of a half
#pragma unroll
      for (int hh = 0; hh < SPLIT_NH; ++hh) {
        const int b = 2 * hh + (lt >> 1);
#pragma unroll
        for (int p = 0; p < SPLIT_E; ++p) {
          u32 x0 = 0u, x1 = 0u;
          if (SPLIT_M >= 16 || b < SPLIT_PB) {  // (m = 8: threads 2, 3 feed zeros to zero query entries)
            x0 = __byte_perm((u32)r0[3 + SPLIT_PB * p + b], 0u, 0x4040);
            x1 = __byte_perm((u32)r1[3 + SPLIT_PB * p + b], 0u, 0x4040);
          }
          mma(ch, (x0 & m01) | q.magic, (x1 & m01) | q.magic, (x0 & m23) | q.magic, (x1 & m23) | q.magic,
              q.qu[2 * (SPLIT_E * hh + p)], q.qu[2 * (SPLIT_E * hh + p) + 1], ch);
        }
      }
    }
#else
#pragma unroll
    for (int hh = 0; hh < SPLIT_NH; ++hh) {
      const int b = 2 * hh + (lt >> 1), sh = 4 * (lt & 1);  // plane byte, bit: channels b + (sh + i) m/8, i < 4
      u32 u0 = 0u, u1 = 0u;  // byte i: channel i's upper code
      if (SPLIT_M >= 16 || b < SPLIT_PB) {  // (m = 8: threads 2, 3 feed zeros to zero query entries)
#pragma unroll
        for (int p = 0; p < SPLIT_E; ++p) {
          const u32 n0 = ((u32)r0[3 + SPLIT_PB * p + b] >> sh) & 15u, n1 = ((u32)r1[3 + SPLIT_PB * p + b] >> sh) & 15u;
          u0 |= ((n0 * 0x00204081u) & 0x01010101u) << p;  // bit i of the nibble to bit 0 of byte i
          u1 |= ((n1 * 0x00204081u) & 0x01010101u) << p;
        }
      }
      u0 <<= KBITS;  // u 2^KBITS < 2^SPLIT_HB <= 256: a byte still
      u1 <<= KBITS;
      mma(ch, __byte_perm(u0, 0u, 0x4140) | q.magic, __byte_perm(u1, 0u, 0x4140) | q.magic,
          __byte_perm(u0, 0u, 0x4342) | q.magic, __byte_perm(u1, 0u, 0x4342) | q.magic, q.qu[2 * hh],
          q.qu[2 * hh + 1], ch);
    }
#endif
    const float hs0 = f16_to_f32((u16)(r0[0] | (r0[1] << 8))), hs1 = f16_to_f32((u16)(r1[0] | (r1[1] << 8)));
    const float hz0 = hs0 * (float)r0[2], hz1 = hs1 * (float)r1[2];
#endif
    float2 ks, kz;  // (token g, token g+8)
    scale_zero(cur[u].km, ks, kz);
    // s z qz does not wait for the MMAs: after them one FFMA a logit, as with a stored minimum
    const float sz0 = ks.x * kz.x, sz1 = ks.y * kz.y;
#if SPLIT_M
    sc[u][0] = fmaf(ks.x, c[0], sz0 * q.qz0) + fmaf(hs0, ch[0], hz0 * q.qzh0);
    sc[u][1] = fmaf(ks.x, c[1], sz0 * q.qz1) + fmaf(hs0, ch[1], hz0 * q.qzh1);
    sc[u][2] = fmaf(ks.y, c[2], sz1 * q.qz0) + fmaf(hs1, ch[2], hz1 * q.qzh0);
    sc[u][3] = fmaf(ks.y, c[3], sz1 * q.qz1) + fmaf(hs1, ch[3], hz1 * q.qzh1);
#else
    sc[u][0] = fmaf(ks.x, c[0], sz0 * q.qz0);
    sc[u][1] = fmaf(ks.x, c[1], sz0 * q.qz1);
    sc[u][2] = fmaf(ks.y, c[2], sz1 * q.qz0);
    sc[u][3] = fmaf(ks.y, c[3], sz1 * q.qz1);
#endif
#endif
  }
#undef KMMA
#undef QH1
#if ROPE_R
  rope_terms<HALF ? 1 : 2>(sc, rph);
#endif
#if SLIDING
  if (skip > 0) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (16 * u + g < skip) sc[u][0] = sc[u][1] = NEG_INF;
      if (16 * u + g + 8 < skip) sc[u][2] = sc[u][3] = NEG_INF;
    }
  }
#endif
  // ---- online softmax over the step (columns 2t, 2t+1 of this thread)
  const float mx0 = fmaxf(fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[1][0], sc[1][2]));
  const float mx1 = fmaxf(fmaxf(sc[0][1], sc[0][3]), fmaxf(sc[1][1], sc[1][3]));
  if (!raise_max(st, mx0, mx1) && ++st.since_flush == FLUSH_STEPS) flush_offset(st);
  u32 bv[2][2];  // value MMA B operand per sub-tile: PP of tokens (2t, 2t+1) and (2t+8, 2t+9), head g
#if NG == 2
  u32 bvh[2][2];  // the same with group 1's scales (bv: group 0's)
#define BV(s, u, k) ((s) ? bvh[u][k] : bv[u][k])
#else
#define BV(s, u, k) bv[u][k]
#endif
#pragma unroll
  for (int u = 0; u < (HALF ? 1 : 2); ++u) {
    const float m0 = safe_max(st.m0), m1 = safe_max(st.m1);
    const float p0 = ex2(sc[u][0] - m0), p1 = ex2(sc[u][1] - m1);
    const float p2 = ex2(sc[u][2] - m0), p3 = ex2(sc[u][3] - m1);
    st.l0 += p0 + p2;
    st.l1 += p1 + p3;
#if NG == 2
    float2 vs0, vz0, vs1, vz1;  // (group 0, group 1) scales and zero points of token g (vs0, vz0) and g+8
    scale_zero2(cur[u].vm, 0, vs0, vz0);
    scale_zero2(cur[u].vm, 1, vs1, vz1);
    const float2 sz0 = make_float2(vs0.x * vz0.x, vs0.y * vz0.y), sz1 = make_float2(vs1.x * vz1.x, vs1.y * vz1.y);
    st.n0 += p0 * sz0.x + p2 * sz1.x;
    st.n1 += p1 * sz0.x + p3 * sz1.x;
    st.nh0 += p0 * sz0.y + p2 * sz1.y;
    st.nh1 += p1 * sz0.y + p3 * sz1.y;
    bv[u][0] = transpose8x8(pack_half2(p0 * vs0.x, p1 * vs0.x));
    bv[u][1] = transpose8x8(pack_half2(p2 * vs1.x, p3 * vs1.x));
    bvh[u][0] = transpose8x8(pack_half2(p0 * vs0.y, p1 * vs0.y));
    bvh[u][1] = transpose8x8(pack_half2(p2 * vs1.y, p3 * vs1.y));
#else
    float2 vs, vz;  // (token g, token g+8)
    scale_zero(cur[u].vm, vs, vz);
    const float sz0 = vs.x * vz.x, sz1 = vs.y * vz.y;
    st.n0 += p0 * sz0 + p2 * sz1;
    st.n1 += p1 * sz0 + p3 * sz1;
    bv[u][0] = transpose8x8(pack_half2(p0 * vs.x, p1 * vs.x));
    bv[u][1] = transpose8x8(pack_half2(p2 * vs.y, p3 * vs.y));
#endif
  }
  // ---- pending offset += 1024 * sum(PP) per head, from the same float16 PP the value MMAs see.  It leaves acc
  // every FLUSH_STEPS steps (256 tokens, as the Triton kernel's tile): the H100's MMA accumulation truncates, so
  // acc must not carry ~1024x the signal for long.
  mma(st.pend, 0x64006400u, 0x64006400u, 0x64006400u, 0x64006400u, bv[0][0], bv[0][1], st.pend);
  if (!HALF) mma(st.pend, 0x64006400u, 0x64006400u, 0x64006400u, 0x64006400u, bv[1][0], bv[1][1], st.pend);
#if NG == 2
  mma(st.pend_hi, 0x64006400u, 0x64006400u, 0x64006400u, 0x64006400u, bvh[0][0], bvh[0][1], st.pend_hi);
  if (!HALF) mma(st.pend_hi, 0x64006400u, 0x64006400u, 0x64006400u, 0x64006400u, bvh[1][0], bvh[1][1], st.pend_hi);
#endif
  // ---- values: block i holds channel combos 2i (row g) and 2i+1 (row g+8); combo j = byte VB g + j/4, slice j%4
#if VBITS == 3
  const int vsh = 2 - ((threadIdx.x >> 4) & 1);  // 2 - (g >> 2): slice s's high bit from 2s + (g >> 2) to 2s + 2
#endif
#pragma unroll
  for (int u = 0; u < (HALF ? 1 : 2); ++u) {
#pragma unroll
    for (int by = 0; by < VB; ++by) {
#if D > 128
      const int bb = by & 3, bw = by >> 2;  // byte bb of the tokens' words bw
      const u32 sel = bb | (bb << 4) | ((bb + 4) << 8) | ((bb + 4) << 12);
      const u32 za = __byte_perm(word(cur[u].v[0], bw), word(cur[u].v[1], bw), sel);  // tokens 2t, 2t+1
      const u32 zb = __byte_perm(word(cur[u].v[2], bw), word(cur[u].v[3], bw), sel);  // tokens 2t+8, 2t+9
#if VBITS != 2
      const u32 ya = __byte_perm(word(cur[u].vx[0], bw), word(cur[u].vx[1], bw), sel);
      const u32 yb = __byte_perm(word(cur[u].vx[2], bw), word(cur[u].vx[3], bw), sel);
#endif
#else
      const u32 sel = by | (by << 4) | ((by + 4) << 8) | ((by + 4) << 12);
      const u32 za = __byte_perm(cur[u].v[0], cur[u].v[1], sel);  // tokens 2t, 2t+1
      const u32 zb = __byte_perm(cur[u].v[2], cur[u].v[3], sel);  // tokens 2t+8, 2t+9
#if VBITS != 2
      const u32 ya = __byte_perm(cur[u].vx[0], cur[u].vx[1], sel);
      const u32 yb = __byte_perm(cur[u].vx[2], cur[u].vx[3], sel);
#endif
#endif
#if VBITS == 3
      // (lo, hi): slices 0, 2 and 1, 3 of tokens 2t, 2t+1 (a) and 2t+8, 2t+9 (b)
      const u32 ea = ya << vsh, eb = yb << vsh;
      const u32 la = value_bits3(za, ea, 0), ha = value_bits3(za, ea, 1);
      const u32 lb = value_bits3(zb, eb, 0), hb = value_bits3(zb, eb, 1);
#elif VBITS == 4
      const u32 la = za, ha = ya << 2, lb = zb, hb = yb << 2;
#endif
#pragma unroll
      for (int s = 0; s < 4; s += 2) {
        const int i = (4 * by + s) / 2;
#if VBITS == 2
        mma(st.acc[i], code_half2(za, s, q.magic), code_half2(za, s + 1, q.magic), code_half2(zb, s, q.magic), code_half2(zb, s + 1, q.magic),
            BV(s, u, 0), BV(s, u, 1), st.acc[i]);
#else
        mma(st.acc[i], value_a(la, ha, s, q.magic), value_a(la, ha, s + 1, q.magic), value_a(lb, hb, s, q.magic),
            value_a(lb, hb, s + 1, q.magic), BV(s, u, 0), BV(s, u, 1), st.acc[i]);
#endif
      }
    }
  }
#undef BV
}


// ---------------------------------------------------------------------------------------------- BF16 window
// The window of a sequence: sink tokens [0, sink_end) and recent tokens [r0, T), in 16-token sub-tiles (sink
// sub-tiles first; both ranges start on page boundaries, so a sub-tile lies in one page).
struct Window {
  const u16* k;  // key window pool + head + D4 t: this thread's key channels D4 t .. D4 t + D4 - 1
  const u16* v;  // value window pool + head + VB g: its value channels VB g + D4 s .. + VB - 1, s = 0..3
  const int* bt;  // the sequence's block-table row
  long long page_stride;  // elements
  int n_sink, sink_end, r0, T, n;  // n: sub-tiles in all
  int lo;  // the first token the query sees (0 unless SLIDING)
};

// What one thread loads of a window sub-tile (bfloat16 pairs; zeros for tokens past the range).
// At D = 256 the values (64 more registers) are not loaded ahead: window_tile reads them, half the slices at a time.
struct WinTile {
  uint4 k[2][D / 32];  // tokens g, g + 8: key channels D4 t .. D4 t + D4 - 1
#if D > 128
  const u16* v;        // the sub-tile's first value row at this thread's channels (win.v + row)
#else
  wval_t v[4][4];      // tokens 2t, 2t + 1, 2t + 8, 2t + 9: value channels VB g + D4 s .. VB g + D4 s + VB - 1
#endif
  int base, limit, lo;  // first token of the sub-tile, end of its range, first token the query sees
};

__device__ __forceinline__ void load_win_tile(WinTile& w, const Window& win, int j, int g, int t) {
  const bool sink = j < win.n_sink;
  w.base = sink ? 16 * j : win.r0 + 16 * (j - win.n_sink);
  w.limit = sink ? win.sink_end : win.T;
  w.lo = win.lo;
  const long long row = (long long)win.bt[w.base / P] * win.page_stride + (w.base % P) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tok = g + 8 * r;
    const bool ok = w.base + tok < w.limit && (!SLIDING || w.base + tok >= w.lo);
    const uint4* src = reinterpret_cast<const uint4*>(win.k + row + tok * D);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) w.k[r][i] = ok ? __ldg(src + i) : make_uint4(0, 0, 0, 0);
  }
#if D > 128
  w.v = win.v + row;
#else
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int tok = 2 * t + (r & 1) + 8 * (r >> 1);
    const bool ok = w.base + tok < w.limit && (!SLIDING || w.base + tok >= w.lo);
#pragma unroll
    for (int s = 0; s < 4; ++s)
      w.v[r][s] = ok ? __ldg(reinterpret_cast<const wval_t*>(win.v + row + tok * D + D4 * s)) : wval_t{};
  }
#endif
}

__device__ __forceinline__ u32 word_of(const uint4* a, int m) {  // word m of 16 (m is a compile-time constant)
  const uint4 x = a[m >> 2];
  return (m & 3) == 0 ? x.x : (m & 3) == 1 ? x.y : (m & 3) == 2 ? x.z : x.w;
}

// One value MMA of a window sub-tile: x holds the words of tokens (2t, 2t+1, 2t+8, 2t+9) x slices (s, s + 1) that
// carry channel VB g + by; its bfloat16 halves (the high or the low one by by's parity) times 4^s, as the INT2 codes'.
__device__ __forceinline__ void window_value_mma(float* acc, const u32 (&x)[4][2], int by, int s, u32 b0, u32 b1) {
  const u32 sel = (by & 1) ? 0x7632u : 0x5410u;  // the high or the low bfloat16 of two tokens' words
  const u32 a0 = bf16x2_times_4pow(__byte_perm(x[0][0], x[1][0], sel), s);
  const u32 a1 = bf16x2_times_4pow(__byte_perm(x[0][1], x[1][1], sel), s + 1);
  const u32 a2 = bf16x2_times_4pow(__byte_perm(x[2][0], x[3][0], sel), s);
  const u32 a3 = bf16x2_times_4pow(__byte_perm(x[2][1], x[3][1], sel), s + 1);
  mma_bf16(acc, a0, a1, a2, a3, b0, b1, acc);
}

// One window sub-tile into the warp's running state.  Keys: logical k (2t, 2t+1) of k-step kk is channel
// D4 t + 4kk (+1), (2t+8, 2t+9) is D4 t + 4kk + 2 (+3): a thread's words, and 4 consecutive query channels.
// Values: accumulator block i holds, in row g, channel VB g + i/2 + D/2 (i % 2) times 4^(2 (i % 2)), in row g + 8
// the channel D/4 above it times 4^(2 (i % 2) + 1), as the INT2 codes' slices (see step()).
__device__ __forceinline__ void window_tile(State& st, const WinTile& w, const u16* qhi, const u16* qlo, int g,
                                            const float2* __restrict__ PH, int pair) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const uint2 bh = *reinterpret_cast<const uint2*>(qhi + 4 * kk);
    const uint2 bl = *reinterpret_cast<const uint2*>(qlo + 4 * kk);
    const u32 a0 = word_of(w.k[0], 2 * kk), a1 = word_of(w.k[1], 2 * kk);
    const u32 a2 = word_of(w.k[0], 2 * kk + 1), a3 = word_of(w.k[1], 2 * kk + 1);
    mma_bf16(c, a0, a1, a2, a3, bh.x, bh.y, c);
    mma_bf16(c, a0, a1, a2, a3, bl.x, bl.y, c);
  }
#if ROPE_R
  rope_terms_window(&c, PH, w.base, pair);
#endif
  const bool ok0 = w.base + g < w.limit && (!SLIDING || w.base + g >= w.lo);
  const bool ok1 = w.base + g + 8 < w.limit && (!SLIDING || w.base + g + 8 >= w.lo);
  const float s0 = ok0 ? c[0] : NEG_INF, s1 = ok0 ? c[1] : NEG_INF;
  const float s2 = ok1 ? c[2] : NEG_INF, s3 = ok1 ? c[3] : NEG_INF;
  raise_max(st, fmaxf(s0, s2), fmaxf(s1, s3));
  const float m0 = safe_max(st.m0), m1 = safe_max(st.m1);
  const float p0 = ex2(s0 - m0), p1 = ex2(s1 - m1), p2 = ex2(s2 - m0), p3 = ex2(s3 - m1);
  st.l0 += p0 + p2;
  st.l1 += p1 + p3;
  const u32 b0 = transpose8x8(pack_bf16x2(p0, p1)), b1 = transpose8x8(pack_bf16x2(p2, p3));
#if D > 128
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // slices 2 half, 2 half + 1: the blocks i with i % 2 == half
    const int s = 2 * half;
    wval_t v[4][2];  // tokens (2t, 2t+1, 2t+8, 2t+9) x slices (s, s + 1)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tok = 2 * t + (r & 1) + 8 * (r >> 1);
      const bool ok = w.base + tok < w.limit && (!SLIDING || w.base + tok >= w.lo);
#pragma unroll
      for (int e = 0; e < 2; ++e)
        v[r][e] = ok ? __ldg(reinterpret_cast<const wval_t*>(w.v + tok * D + D4 * (s + e))) : wval_t{};
    }
#pragma unroll
    for (int i = half; i < KSTEPS; i += 2) {
      const int by = i >> 1;
      u32 x[4][2];  // tokens (2t, 2t+1, 2t+8, 2t+9) x slices (s, s + 1): the word holding channel VB g + by
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        x[r][0] = word(v[r][0], by >> 1);
        x[r][1] = word(v[r][1], by >> 1);
      }
      window_value_mma(st.acc[i], x, by, s, b0, b1);
    }
  }
#else
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    const int by = i >> 1, s = 2 * (i & 1);
    u32 x[4][2];  // tokens (2t, 2t+1, 2t+8, 2t+9) x slices (s, s + 1): the word holding channel VB g + by
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      x[r][0] = word(w.v[r][s], by >> 1);
      x[r][1] = word(w.v[r][s + 1], by >> 1);
    }
    window_value_mma(st.acc[i], x, by, s, b0, b1);
  }
#endif
}

// The warps' results for head hh at channel ch: num = sum_w e_w (acc_w + n_w), den = sum_w e_w l_w with
// e_w = 2^(m_w - mx), mx = max_w m_w (num = den = 0 where no warp saw a token).  WITH_N: add the n_w term.
template <bool WITH_N>
__device__ __forceinline__ void combine_warps(const float (*acc)[8][D], const float (*m)[8], const float (*l)[8],
                                              const float (*n)[8], int hh, int ch, float& num, float& den,
                                              float& mx) {
  mx = NEG_INF;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, m[w][hh]);
  num = den = 0.f;
  if (mx != NEG_INF) {
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      const float e = ex2(m[w][hh] - mx);
      num += e * (WITH_N ? acc[w][hh][ch] + n[w][hh] : acc[w][hh][ch]);
      den += e * l[w][hh];
    }
  }
}

// ---------------------------------------------------------------------------------------------- the merge
// The last CTA of a (sequence, KV head) merges its splits' partials (po: [GQA heads][splits][D] float16 at strides
// stride_poh, stride_pos; pl: their log2-sum-exps at [hh * stride_plh + split]) into o ([GQA heads][D] at stride_oh);
// m, l: shared scratch for a max and a weight sum per head.
// Short, rolled loops: the merge runs once per (sequence, KV head), after the history's bytes have pushed the
// kernel's code out of L2, so every instruction it runs the first time comes from DRAM (fully unrolled it was 27 KB
// of machine code; benchmarks/NOTES.md, run M1).  Inlined or not changes how ptxas compiles the history loop, and
// the two were timed: not inlined the plain kernels' loop ran 1-2.5% faster, inlined the split keys' 3-4%.
#if SPLIT_M
#define MERGE_INLINE __forceinline__
#else
#define MERGE_INLINE __noinline__
#endif
__device__ MERGE_INLINE void merge_partials(const u16* __restrict__ po, const float* __restrict__ pl, int stride_poh,
                                            int stride_pos, int stride_plh, int splits, o_t* __restrict__ o,
                                            int stride_oh, float* m, float* l) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 1. Warp w takes heads w, w + NWARPS, ...: lanes go over the splits with a running max and weight sum of their
  //    log-sum-exps, then a butterfly combines the lanes (m[hh], l[hh]).
  for (int hh = warp; hh < GQA; hh += NWARPS) {
    float m_run = NEG_INF, tot = 0.f;
#pragma unroll 1
    for (int s = lane; s < splits; s += 32) {
      const float x = __ldcg(pl + (long long)hh * stride_plh + s);
      const float mn = fmaxf(m_run, x);
      if (mn != NEG_INF) {
        tot = tot * ex2(m_run - mn) + ex2(x - mn);  // ex2(-inf) = 0: an empty split or nothing before
        m_run = mn;
      }
    }
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) {
      const float mo = __shfl_xor_sync(0xffffffffu, m_run, o2), to = __shfl_xor_sync(0xffffffffu, tot, o2);
      const float mn = fmaxf(m_run, mo);
      tot = mn == NEG_INF ? 0.f : tot * ex2(m_run - mn) + to * ex2(mo - mn);
      m_run = mn;
    }
    if (lane == 0) {
      m[hh] = m_run;
      l[hh] = tot;
    }
  }
  __syncthreads();
  // 2. A thread per 4 channels of a head sums the splits' partials with their weights, MU splits' loads at a time.
  constexpr int MU = 8;
  for (int idx = threadIdx.x; idx < GQA * (D / 4); idx += NT) {
    const int hh = idx / (D / 4), c4 = idx % (D / 4);
    const float m_h = m[hh], tot = l[hh];
    const float* plh = pl + (long long)hh * stride_plh;
    const uint2* poh = reinterpret_cast<const uint2*>(po + (long long)hh * stride_poh) + c4;  // stride_pos % 4 == 0
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int s0 = 0; s0 < splits; s0 += MU) {
      float lse[MU];
      uint2 p[MU];
#pragma unroll
      for (int u = 0; u < MU; ++u) {
        const bool ok = s0 + u < splits;
        lse[u] = ok ? __ldcg(plh + s0 + u) : NEG_INF;
        p[u] = ok ? __ldcg(poh + (long long)(s0 + u) * (stride_pos / 4)) : make_uint2(0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < MU; ++u) {
        const float w = lse[u] == NEG_INF ? 0.f : ex2(lse[u] - m_h);
        const float2 p01 = halves(p[u].x), p23 = halves(p[u].y);
        acc.x += w * p01.x;
        acc.y += w * p01.y;
        acc.z += w * p23.x;
        acc.w += w * p23.y;
      }
    }
    const float inv = tot > 0.f ? 1.f / tot : 0.f;
    o_t* out = o + (long long)hh * stride_oh + 4 * c4;
    out[0] = o_from(acc.x * inv);
    out[1] = o_from(acc.y * inv);
    out[2] = o_from(acc.z * inv);
    out[3] = o_from(acc.w * inv);
  }
}

// ---------------------------------------------------------------------------------------------- the kernel
extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS) oscar_int2_decode(
    const q_t* __restrict__ Q, const u16* __restrict__ RT, int rotate, const unsigned char* __restrict__ Kc,
    const u16* __restrict__ Ks, const unsigned char* __restrict__ Kz, const unsigned char* __restrict__ Vc,
    const u16* __restrict__ Vs, const unsigned char* __restrict__ Vz,
    const u16* __restrict__ Kw, const u16* __restrict__ Vw, const int* __restrict__ BT,
    const int* __restrict__ SL, const int* __restrict__ NQ, u16* __restrict__ PO, float* __restrict__ PL,
    o_t* __restrict__ O, int* __restrict__ CNT, double qk_scale_d, int stride_qb, int stride_qh, int stride_rh,
    int stride_cp, int stride_ch, int stride_mp, int stride_mh, int stride_wp, int stride_wh, int stride_bt,
    int stride_pob, int stride_poh, int stride_pos, int stride_plb, int stride_plh, int stride_ob, int stride_oh,
    int chunk, int magic, unsigned long long* __restrict__ TS, int evict_first, const float* __restrict__ RMU,
    const int* __restrict__ PR, const float2* __restrict__ PH, const float2* __restrict__ TL, int window
#if KV_STRIDES
    , int stride_kcp, int stride_kch  // key codes' page and head strides (their rows are KROW bytes)
#endif
    ) {
  const int split = blockIdx.x, splits = gridDim.x;
  const int y = blockIdx.y, b = blockIdx.z;  // y: (KV head, query group)
  const int h = y / QGROUPS, hq0 = y * GQA;   // the KV head, this CTA's first query head
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float qk_scale = (float)qk_scale_d;
  const int T = SL[b], nq = NQ[b];
#if SLIDING
  const int lo = max(T - window, 0), lo_h = max(lo - SINK_PAGES * P, 0);  // in the sequence, in the history
  const int start = (lo_h < nq * P ? lo_h / P * P : nq * P) + split * chunk;  // the splits start at lo's page
#else
  const int lo = 0;
  const int start = split * chunk;
#endif
  const int end = min(start + chunk, nq * P);
  STAMP(0);

#if D <= 128
  // ---- R^T rows of this warp's rotation tiles go out first (they need nothing), see "query rotation" below
  uint4 ra[MT][2][D / 32];  // [m tile][row g, g + 8][16 bytes]: float16 R^T[e][D4 t .. D4 t + D4 - 1]
  if (rotate) {
    const u16* rt = RT + (long long)h * stride_rh + D4 * t;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int i = 0; i < D / 32; ++i)
          ra[mt][r][i] = __ldg(reinterpret_cast<const uint4*>(rt + (RQ * warp + 16 * mt + g + 8 * r) * D) + i);
  }
#endif

#if D > 128
  // D = 256: the arrays below would take 60 KB, past the 48 KB of static shared memory.  The warps' outputs (s_acc)
  // are written only after every warp is done with the query, the pages and the window (a barrier before the
  // combine), so they share the space with them.
  __shared__ __align__(16) union {
    float acc[NWARPS][8][D];
    struct {
      uint2 qb[KSTEPS][32];  // the key MMAs' B fragments (see ld_shared_u2)
      float q[8][D];
      u16 qw[2][8][D];
      int pages[MAX_PAGES];
    } pre;
  } s_u;
  static_assert(sizeof(s_u.pre) <= sizeof(s_u.acc), "the prologue's arrays fit the warps' outputs");
  int (&s_pages)[MAX_PAGES] = s_u.pre.pages;
  float (&s_acc)[NWARPS][8][D] = s_u.acc;  // the warps' outputs (partial, merge)
  uint2 (&s_qb)[KSTEPS][32] = s_u.pre.qb;
  float (&s_q)[8][D] = s_u.pre.q;          // the query rows (then rotated and scaled)
  u16 (&s_qw)[2][8][D] = s_u.pre.qw;       // the same as bfloat16 hi and lo parts (window keys)
#else
  __shared__ int s_pages[MAX_PAGES];
  __shared__ __align__(16) float s_acc[NWARPS][8][D];  // the rotated query; the warps' outputs (partial, merge)
  __shared__ __align__(16) float s_q[8][D];  // the query rows (then rotated and scaled)
  __shared__ __align__(16) u16 s_qw[2][8][D];  // the same as bfloat16 hi and lo parts (window keys)
#endif
  __shared__ float s_m[NWARPS][8], s_l[NWARPS][8], s_n[NWARPS][8];
  __shared__ int s_last;

  // ---- prologue: page ids and query rows to shared memory, this warp's first window sub-tile to registers
  const int* bt_row = BT + (long long)b * stride_bt;
  for (int i = threadIdx.x; i < (end - start + P - 1) / P; i += NT) s_pages[i] = bt_row[SINK_PAGES + start / P + i];
#if __CUDA_ARCH__ >= 900
  // Launched with PDL (kernels/pdl.py) this CTA may have started before the kernel that writes this step's query and
  // window rows finished: everything above read only the step's plan and R^T.  Wait for it, then let the next launch.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  for (int i = threadIdx.x; i < 8 * D; i += NT) {
    const int hh = i / D;
    s_q[hh][i % D] = hh < GQA ? q_float(Q[(long long)b * stride_qb + (long long)(hq0 + hh) * stride_qh + i % D])
                              : 0.f;
  }
  Window win;
  win.k = Kw + (long long)h * stride_wh + D4 * t;
  win.v = Vw + (long long)h * stride_wh + VB * g;
  win.bt = bt_row;
  win.page_stride = stride_wp;
  win.sink_end = min(T, SINK_PAGES * P);
  win.n_sink = (win.sink_end + 15) / 16;
  win.r0 = min(SINK_PAGES * P + nq * P, T);
#if SLIDING
  if (lo >= win.sink_end) win.n_sink = 0;
  if (lo > win.r0) win.r0 += (lo - win.r0) / 16 * 16;  // recent sub-tiles wholly below the window
#endif
  win.T = T;
  win.lo = lo;
  win.n = win.n_sink + (T - win.r0 + 15) / 16;
  int wj = split + splits * warp;  // window sub-tiles j of this warp: j % splits == split, (j / splits) % NWARPS == warp
  WinTile wt;
  if (wj < win.n) load_win_tile(wt, win, wj, g, t);
  __syncthreads();
  STAMP(1);
  // ---- the first INT2 loads go out as soon as the page ids are in shared memory: their DRAM latency overlaps the
  // position-aware term's tables, the query rotation and the window sub-tile (split keys' tails: below, once the
  // rotation is done with s_acc, which they overlay).  Not at head dim 128 with 3 CTAs per SM (held beside the
  // rotation's R^T fragments they spill at its 168 registers) nor with split keys (their loop ran 4-6% slower):
  // there they go out after the rotation (EARLY_LOADS).
  Source src;
#if !KV_STRIDES
  src.k = Kc + (long long)h * stride_ch + g * D4 + KB * t;
#else
  src.k = Kc + (long long)h * stride_kch + g * KROW + KB * t;
#if KBITS != 2
  src.kx = src.k + D4 + (KBITS == 3 ? KB * (t & 1) - KB * t : 0);
#endif
#if KBITS == 5
  src.kh = src.k + D / 2 + KB * (t & 1) - KB * t;
#endif
  src.kcp = (unsigned long long)stride_kcp;
#endif
#if SPLIT_M
  src.kt = Kc + (long long)h * stride_kch + P * KROW;
#endif
  src.v = Vc + (long long)h * stride_ch + 2 * t * VROW + VB * g;
#if VBITS != 2
  src.vx = src.v + D4 + (VBITS == 3 ? VB * (g & 3) - VB * g : 0);
#endif
  src.ks = Ks + (long long)h * stride_mh + 2 * g * NG;  // tokens g and g + 8 sit at slots 2g, 2g + 1
  src.kz = Kz + (long long)h * stride_mh + 2 * g * NG;
  src.vs = Vs + (long long)h * stride_mh + 2 * g * NG;
  src.vz = Vz + (long long)h * stride_mh + 2 * g * NG;
  src.pages = s_pages;
  src.cp = (unsigned long long)stride_cp;
  src.mp = (unsigned long long)stride_mp;
  src.first = start;
  src.policy = stream_policy(evict_first);
#if STEP16
  SubTile buf0[1], buf1[1];
  int pos = start + 16 * warp;
#if EARLY_LOADS
  if (pos < end) load_sub_tile(buf0[0], src, pos);
#endif
#else
  SubTile buf0[2], buf1[2];
  int pos = start + 32 * warp;
  const int full_end = end - 31;  // pos < full_end <=> pos + 32 <= end
#if SPLIT_M
  // split keys: buffer bf's two sub-tiles' tails (the warp's s_acc rows: the header's SPLIT_M paragraph).  A copy
  // group is committed at every load point, issued or not, so waiting for all but the newest group finds the tails
  // of the step about to run in place; a buffer is refilled only after every lane has read it (__syncwarp).
  unsigned char* const tails = reinterpret_cast<unsigned char*>(&s_acc[warp][0][0]);
#define TAILS(bf) (tails + 32 * KTAIL * (bf))
#define LOAD_TAILS(bf, p) { \
  __syncwarp(); \
  load_tails(TAILS(bf), src, p); \
  load_tails(TAILS(bf) + 16 * KTAIL, src, (p) + 16); }
#define COMMIT_TAILS() tails_commit()
#define WAIT_TAILS(n) tails_wait<n>()
#else
#define TAILS(bf) nullptr
#define LOAD_TAILS(bf, p)
#define COMMIT_TAILS()
#define WAIT_TAILS(n)
#endif
#if EARLY_LOADS
  if (pos < full_end) {
    load_sub_tile(buf0[0], src, pos);
    load_sub_tile(buf0[1], src, pos + 16);
  }
#endif
#endif
#if ROPE_R
  const int rpair = PR[(long long)h * ROPE_R + min(lane, ROPE_R - 1)];  // the pair whose phases this lane stages
#define ROPE_PHASE(p) rope_phase(PH, SINK_PAGES * P + (p), rpair, (p) < end)
#else
  const int rpair = 0;
#define ROPE_PHASE(p) make_float2(0.f, 0.f)
#endif
  float2 rph = ROPE_PHASE(pos);  // the phase of this warp's current step, the next one's read a step ahead
#if ROPE_R
  rope_prologue(s_q, RMU + (long long)h * D, PR + (long long)h * ROPE_R, TL, qk_scale);  // before s_q is rotated
#endif

  // ---- the query rotation on the tensor cores: qr^T[e, heads] = R^T[e, d] . q^T[d, heads], float16 R^T (A;
  // warp w: rows e in [RQ w, RQ w + RQ)) times the query as float16 hi + lo parts (B, ~22 bits).  Logical k
  // (2t, 2t+1) of k-step kk is channel d = D4 t + 4kk (+1), (2t+8, 2t+9) is D4 t + 4kk + 2 (+3), so each
  // thread feeds the D/2 contiguous bytes it loaded of each R^T row.
#if D > 128
  // D = 256 does not rotate here: it takes the rotated query from the host (decode.rotate_query, one launch; in
  // here each CTA would read the whole 128 KB R^T from L2, ~18 us per call on the H200 whatever the batch).  RT is
  // then that float32 [B, Hq, D] query and Q the unrotated one, which only the RoPE prologue reads (rotate = 0: Q
  // is rotated, or no rotation applies).
  const float* QR = reinterpret_cast<const float*>(RT) + ((long long)b * gridDim.y * GQA + hq0) * D;
  __syncthreads();
#pragma unroll
  for (int e = threadIdx.x; e < D; e += NT) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = i < GQA ? (rotate ? __ldg(QR + i * D + e) : s_q[i][e]) * qk_scale : 0.f;
      s_q[i][e] = x;
      const u16 h16 = f32_to_bf16(x);
      s_qw[0][i][e] = h16;
      s_qw[1][i][e] = f32_to_bf16(x - bf16_to_f32(h16));
    }
  }
  __syncthreads();
  // the key MMAs' B fragments (Query below): pair k of lane ln is registers 2k, 2k + 1 of the D <= 128 layout, i.e.
  // channels (j, j + 2) + D/4 s (s = 0, 1 for even k, 2, 3 for odd k) of head gg, j = KB tt + 4w + hp,
  // k = 4w + 2hp + s/2
  for (int idx = threadIdx.x; idx < KSTEPS * 32; idx += NT) {
    const int ln = idx & 31, k = idx >> 5, gg = ln >> 2, tt = ln & 3;
    const int w = k >> 2, hp = (k >> 1) & 1, s = 2 * (k & 1);
    const int j = KB * tt + 4 * w + hp;
    u32 r[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x0 = gg < GQA ? s_q[gg][j + D4 * (s + e)] : 0.f;
      const float x1 = gg < GQA ? s_q[gg][j + 2 + D4 * (s + e)] : 0.f;
      const float f = __int_as_float((127 - key_shift(s + e)) << 23);  // 2^-key_shift(s + e)
      r[e] = pack_half2(x0 * f, x1 * f);
    }
    s_qb[k][ln] = make_uint2(r[0], r[1]);
  }
  __syncthreads();
#else
  if (rotate) {
    float c[MT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      const float4 x = *reinterpret_cast<const float4*>(&s_q[g][D4 * t + 4 * kk]);
      const u32 hi0 = pack_half2(x.x, x.y), hi1 = pack_half2(x.z, x.w);
      const float2 h0 = halves(hi0), h1 = halves(hi1);
      const u32 lo0 = pack_half2(x.x - h0.x, x.y - h0.y), lo1 = pack_half2(x.z - h1.x, x.w - h1.y);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const u32 a0 = word_of(ra[mt][0], 2 * kk), a1 = word_of(ra[mt][1], 2 * kk);
        const u32 a2 = word_of(ra[mt][0], 2 * kk + 1), a3 = word_of(ra[mt][1], 2 * kk + 1);
        mma(c[mt], a0, a1, a2, a3, hi0, hi1, c[mt]);
        mma(c[mt], a0, a1, a2, a3, lo0, lo1, c[mt]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {  // C: rows e (g, g + 8), columns heads (2t, 2t + 1)
      const int e = RQ * warp + 16 * mt + g;
      s_acc[0][2 * t][e] = c[mt][0];
      s_acc[0][2 * t + 1][e] = c[mt][1];
      s_acc[0][2 * t][e + 8] = c[mt][2];
      s_acc[0][2 * t + 1][e + 8] = c[mt][3];
    }
  }
  __syncthreads();
  if (threadIdx.x < D) {
    const int e = threadIdx.x;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = i < GQA ? (rotate ? s_acc[0][i][e] : s_q[i][e]) * qk_scale : 0.f;
      s_q[i][e] = x;
      const u16 h16 = f32_to_bf16(x);
      s_qw[0][i][e] = h16;
      s_qw[1][i][e] = f32_to_bf16(x - bf16_to_f32(h16));
    }
  }
  __syncthreads();
#endif
  STAMP(2);

#if STEP16 && !EARLY_LOADS
  if (pos < end) load_sub_tile(buf0[0], src, pos);
#elif !STEP16
#if !EARLY_LOADS
  if (pos < full_end) {
    load_sub_tile(buf0[0], src, pos);
    load_sub_tile(buf0[1], src, pos + 16);
  }
#endif
  // split keys: the first step's tails (the rotation above used s_acc[0], which they overlay)
  if (pos < full_end) LOAD_TAILS(0, pos);
  COMMIT_TAILS();
#endif

  State st;
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) st.acc[i][0] = st.acc[i][1] = st.acc[i][2] = st.acc[i][3] = 0.f;
  st.pend[0] = st.pend[1] = st.pend[2] = st.pend[3] = 0.f;
  st.m0 = st.m1 = NEG_INF;
  st.l0 = st.l1 = st.n0 = st.n1 = 0.f;
#if NG == 2
  st.pend_hi[0] = st.pend_hi[1] = st.pend_hi[2] = st.pend_hi[3] = 0.f;
  st.nh0 = st.nh1 = 0.f;
#endif
  st.since_flush = 0;

  // ---- this warp's window sub-tiles (at most one unless the sequence has few splits)
  if (wj < win.n) {
    const u16* qhi = &s_qw[0][g][D4 * t];
    const u16* qlo = &s_qw[1][g][D4 * t];
    window_tile(st, wt, qhi, qlo, g, PH, rpair);
    for (wj += splits * NWARPS; wj < win.n; wj += splits * NWARPS) {
      load_win_tile(wt, win, wj, g, t);
      window_tile(st, wt, qhi, qlo, g, PH, rpair);
    }
  }
  STAMP(3);

  // ---- the query as the key MMAs' B operand (column = head g).  Register i = 8w + 4hp + s holds
  // channels (j, j + 2) + D/4 * s with j = KB t + 4w + hp, divided by 4^s; the A side uses the same order.
  Query q;
  q.magic = (u32)__shfl_sync(0xffffffffu, magic, 0);

  {
    float off_part = 0.f, sum_part = 0.f;
#if NG == 2 || SPLIT_M
    float offh_part = 0.f, sumh_part = 0.f;  // group 1 (slices 2, 3), or a split row's first part
#endif
    const float* qrow = s_q[g < GQA ? g : 0];
#pragma unroll
    for (int w = 0; w < KW; ++w)
#pragma unroll
      for (int hp = 0; hp < 2; ++hp)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int j = KB * t + 4 * w + hp;
          float x0 = g < GQA ? qrow[j + D4 * s] : 0.f;
          float x1 = g < GQA ? qrow[j + 2 + D4 * s] : 0.f;
          const float f = 1.f / (float)(1 << key_shift(s));  // the codes' factor 2^key_shift(s)
#if SPLIT_M
          if (s < 2) {  // channels < m sit in slices 0 and 1: their entries go to qh / qh1, and out of qb
            const float h0 = j + D4 * s < SPLIT_M ? x0 : 0.f, h1 = j + 2 + D4 * s < SPLIT_M ? x1 : 0.f;
            const u32 h2 = pack_half2(h0 * f, h1 * f);
            if (s == 0) q.qh[2 * w + hp] = h2;
#if SPLIT_S1
            else q.qh1[2 * w + hp] = h2;
#endif
            const float2 hf = halves(h2);
            offh_part += hf.x + hf.y;
            sumh_part += h0 + h1;
            x0 -= h0;
            x1 -= h1;
          }
#endif
          const u32 q2 = pack_half2(x0 * f, x1 * f);
#if D > 128
          q.qb = &s_qb[0][lane];  // the same numbers (s_qb, filled after the query scaling)
#else
          q.qb[8 * w + 4 * hp + s] = q2;
#endif
          const float2 qh = halves(q2);
#if NG == 2
          if (s >= 2) {
            offh_part += qh.x + qh.y;
            sumh_part += x0 + x1;
            continue;
          }
#endif
          off_part += qh.x + qh.y;
          sum_part += x0 + x1;
        }
#if SPLIT_M
    // the upper-bit MMAs' B fragments: channels b + (4 (t % 2) + i) m/8 of plane byte b = 2 hh + t / 2 (none at m = 8
    // for t >= 2)
#pragma unroll
    for (int hh = 0; hh < SPLIT_NH; ++hh) {
      const int b = 2 * hh + (t >> 1), c0 = b + 4 * (t & 1) * SPLIT_PB;
      const bool live = g < GQA && b < SPLIT_PB;
#pragma unroll
      for (int p = 0; p < SPLIT_QU; ++p) {
        float y[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // SPLIT_SLICED: plane p's entry of channel c0 + i m/8 sits at bit 4 (t % 2) + i of its byte (step)
          const float f = SPLIT_SLICED ? __int_as_float((127 + KBITS + p - 4 * (t & 1) - i) << 23) : 1.f;
          y[i] = live ? qrow[c0 + i * SPLIT_PB] * f : 0.f;
        }
        const int k = 2 * (SPLIT_QU * hh + p);
        q.qu[k] = pack_half2(y[0], y[1]);
        q.qu[k + 1] = pack_half2(y[2], y[3]);
        const float2 h01 = halves(q.qu[k]), h23 = halves(q.qu[k + 1]);
        offh_part += (h01.x + h01.y) + (h23.x + h23.y);  // (sum(q) has them already: the low bits' sumh_part)
      }
    }
#endif
    off_part = quad_sum(off_part);
    sum_part = quad_sum(sum_part);
    // this thread's output columns are heads 2t and 2t + 1: their sums sit in rows 2t, 2t + 1
    head_pair(off_part, t, 1024.f, q.koff0, q.koff1);
    head_pair(sum_part, t, -KFRAC, q.qz0, q.qz1);
#if NG == 2 || SPLIT_M
    offh_part = quad_sum(offh_part);
    sumh_part = quad_sum(sumh_part);
    head_pair(offh_part, t, 1024.f, q.koffh0, q.koffh1);
    head_pair(sumh_part, t, -HZFRAC, q.qzh0, q.qzh1);
#endif
  }

#if SLIDING
#define STEP_SKIP(p) (lo_h - (p))  // the step's tokens below the window
#else
#define STEP_SKIP(p) 0
#endif
  // ---- full 32-token INT2 steps, loads one step ahead in two alternating buffers; then at most one half step
#if STAMPS
  int nsteps = 0;
#endif
#if STEP16
  // STEP16 (D = 256 variants whose 32-token steps would spill): 16-token steps (one sub-tile, the half step), loads
  // one step ahead in two alternating buffers, half the registers in flight; warps take 16-token steps in turn
#pragma unroll 1
  while (pos < end) {
    int npos = pos + 16 * NWARPS;
    if (npos < end) load_sub_tile(buf1[0], src, npos);
    float2 rnext = ROPE_PHASE(npos);
    step<true>(st, q, buf0, rph, STEP_SKIP(pos), nullptr);
    rph = rnext;
    STEP_STAMP(nsteps);
    pos = npos;
    if (pos >= end) break;
    npos = pos + 16 * NWARPS;
    if (npos < end) load_sub_tile(buf0[0], src, npos);
    rnext = ROPE_PHASE(npos);
    step<true>(st, q, buf1, rph, STEP_SKIP(pos), nullptr);
    rph = rnext;
    STEP_STAMP(nsteps);
    pos = npos;
  }
#else
  // (not unrolled further: each turn is already two steps, and more would only spill)
#pragma unroll 1
  while (pos < full_end) {
    int npos = pos + NT;
    if (npos < full_end) {
      load_sub_tile(buf1[0], src, npos);
      load_sub_tile(buf1[1], src, npos + 16);
      LOAD_TAILS(1, npos);
    }
    COMMIT_TAILS();
    float2 rnext = ROPE_PHASE(npos);
    WAIT_TAILS(1);
    step<false>(st, q, buf0, rph, STEP_SKIP(pos), TAILS(0));
    rph = rnext;
    STEP_STAMP(nsteps);
    pos = npos;
    if (pos >= full_end) break;
    npos = pos + NT;
    if (npos < full_end) {
      load_sub_tile(buf0[0], src, npos);
      load_sub_tile(buf0[1], src, npos + 16);
      LOAD_TAILS(0, npos);
    }
    COMMIT_TAILS();
    rnext = ROPE_PHASE(npos);
    WAIT_TAILS(1);
    step<false>(st, q, buf1, rph, STEP_SKIP(pos), TAILS(1));
    rph = rnext;
    STEP_STAMP(nsteps);
    pos = npos;
  }
  if (pos < end) {  // 16 tokens left for this warp
    load_sub_tile(buf0[0], src, pos);
#if SPLIT_M
    __syncwarp();
    load_tails(TAILS(0), src, pos);
#endif
    COMMIT_TAILS();
    WAIT_TAILS(0);
    step<true>(st, q, buf0, rph, STEP_SKIP(pos), TAILS(0));
  }
  WAIT_TAILS(0);  // (every copy has landed before the warp writes its s_acc rows)
#undef TAILS
#undef LOAD_TAILS
#undef COMMIT_TAILS
#undef WAIT_TAILS
#endif

  STAMP(4);
  // ---- combine the warps: O[h, ch] = sum_w e_w (acc_w[ch, h] / 4^s + n_w[h]) / sum_w e_w l_w[h]
  flush_offset(st);
  st.l0 = warp_sum_rows(st.l0);
  st.l1 = warp_sum_rows(st.l1);
  st.n0 = warp_sum_rows(st.n0) * -VFRAC;  // sum(p s z) -> sum(p min_v)
  st.n1 = warp_sum_rows(st.n1) * -VFRAC;
#if NG == 2
  st.nh0 = warp_sum_rows(st.nh0) * -VFRAC;
  st.nh1 = warp_sum_rows(st.nh1) * -VFRAC;
#endif
#if D > 128
  __syncthreads();  // every warp is done with s_q, s_qw and s_pages, which s_acc overlays
#endif
  if (g == 0) {
    s_m[warp][2 * t] = st.m0;
    s_m[warp][2 * t + 1] = st.m1;
    s_l[warp][2 * t] = st.l0;
    s_l[warp][2 * t + 1] = st.l1;
    s_n[warp][2 * t] = st.n0;
    s_n[warp][2 * t + 1] = st.n1;
  }
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int j = 2 * i + r, s = j % 4;
      const int ch = VB * g + j / 4 + D4 * s;
      const float f = 1.f / (float)(1 << (2 * s));
#if NG == 2
      // block i holds group i % 2's channels: its n is added here (combine_warps without n below)
      s_acc[warp][2 * t][ch] = st.acc[i][2 * r] * f + (i & 1 ? st.nh0 : st.n0);
      s_acc[warp][2 * t + 1][ch] = st.acc[i][2 * r + 1] * f + (i & 1 ? st.nh1 : st.n1);
#else
      s_acc[warp][2 * t][ch] = st.acc[i][2 * r] * f;
      s_acc[warp][2 * t + 1][ch] = st.acc[i][2 * r + 1] * f;
#endif
    }
  }
  __syncthreads();
  const long long po_head = (long long)b * stride_pob + (long long)hq0 * stride_poh;
  const long long pl_head = (long long)b * stride_plb + (long long)hq0 * stride_plh;
  for (int idx = threadIdx.x; idx < GQA * D; idx += NT) {
    const int hh = idx / D, ch = idx % D;
    float num, den, mx;
    combine_warps<NG == 1>(s_acc, s_m, s_l, s_n, hh, ch, num, den, mx);
    // float16 partials: half the bytes for the merge to read (a partial is a weighted mean of values)
    PO[po_head + (long long)hh * stride_poh + (long long)split * stride_pos + ch] =
        f32_to_f16(den > 0.f ? num / den : 0.f);
    if (ch == 0) PL[pl_head + (long long)hh * stride_plh + split] = den > 0.f ? mx + lg2(den) : NEG_INF;
  }

  STAMP(5);
  // ---- the last CTA of this (sequence, KV head) merges the partials
  // Thread 0's count is acq_rel at GPU scope: its release half publishes the CTA's partials (ordered before it
  // by the barrier), its acquire half makes every CTA's partials visible to the loads after the next barrier
  // (one fence in all: no membar on the merging side).
  __syncthreads();
  int* counter = CNT + (long long)b * gridDim.y + y;
  if (threadIdx.x == 0) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
    s_last = before == splits - 1;
  }
  __syncthreads();
  STAMP(6);
  if (!s_last) return;
  STAMP(8);
  merge_partials(PO + po_head, PL + pl_head, stride_poh, stride_pos, stride_plh, splits,
                 O + (long long)b * stride_ob + (long long)hq0 * stride_oh, stride_oh, s_m[0], s_l[0]);
  STAMP(9);
  if (threadIdx.x == 0) *counter = 0;  // every CTA of the pair has counted: ready for the next call
  STAMP(7);
}
