// The fused per-sample kernel of diff2_flwr/core/fused.py (read its docstring for the maths and the contract).
//
// One MLP with one hidden layer, K runs, P clients of N samples. From the compute-dtype quantities of the
// forward pass (hidden activations a, φ'(h), output gradient g_L, output weights W_2) at x and, for a
// difference, at x', it takes in one pass over blocks of BLOCK samples: the backward to the hidden layer
// (in the compute dtype, as the torch path), the float64 per-sample squared norm (the formulas of
// core/ghost.py::norms: cancellation-, underflow- and overflow-safe) and a rigorous upper bound of the true norm
// (ghost.py::norm_bounds, its κ passed in), the clip factor from that bound (clipping.py::clip_factors), the overflow
// flag and the float64 clipped sums — without any [K, width, N] float64 intermediate.
//
// Built with -O3 -ffp-contract=off and without -ffast-math: every operation below is one IEEE operation in
// the order written, and the vectorised loops run over independent samples (lanes), so the bits do not
// depend on the vector width the compiler picks (SSE2, AVX2 or AVX-512) nor on FMA being available (the hottest
// loops are written over the build's native vectors, "packs" below: the same operations lane by lane). Sums
// over samples are taken per lane over the blocks, then over the lanes in order: deterministic, and a run's
// (or a client's) bits do not depend on the other runs (clients) of the call. For T = float, opt-in (``scale`` set:
// fused.py's accumulate="float32"), the sums go through float32 lane partials of fixed windows of blocks, and W_1's
// (with ``xrows``) through float32 products of fixed blocks of samples, each added into float64 (fused.py's
// docstring: the proof that a client sum's sensitivity stays 2C at the radius it passes).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t BLOCK = 16;  // samples per block: the innermost loops run over them (32 or 64: no faster, measured)

// Inputs of one block of one run: rows (one per unit) of ``s`` elements apart, and the shared input's rows
// (one per feature) of ``sx`` elements apart. ``ap == nullptr``: a plain gradient (restart) row.
template <typename T>
struct Block {
  const T *a, *dphi, *gl, *ap, *dphip, *glp;
  const double *x, *sqa, *mask;
  int64_t s, sx;
};

// Where A + B > CANCELLATION (A + B + X), the bracket of a difference row is taken from its QR form.
constexpr double CANCELLATION = 16.0;
// A squared norm in [2^-600, 2^600] whose multipliers (1 + ‖x‖², 1 + ‖a‖², ‖g_L'‖², ‖da‖²) are at most 2^400 lost
// nothing to underflow or overflow (ghost.py's SAFE_SQ, SAFE_MULTIPLIER); another real lane is scaled.
constexpr double SAFE_LO = 0x1p-600, SAFE_HI = 0x1p600, SAFE_MULTIPLIER = 0x1p400;
// Float32 windows: a lane whose input x exceeds float32's range (or is NaN) takes W_1's terms in float64 instead.
constexpr double X_F32_MAX = static_cast<double>(FLT_MAX);

// Bitwise, not short-circuit, so that the loop over a block's lanes vectorises.
inline int risky(double sq, double sqx, double sa, double sgp, double sda, double mask) {
  const int big = (1.0 + sqx > SAFE_MULTIPLIER) | (1.0 + sa > SAFE_MULTIPLIER) | (sgp > SAFE_MULTIPLIER) |
                  (sda > SAFE_MULTIPLIER);
  return (mask > 0.0) & ((!(sq >= SAFE_LO)) | (!(sq <= SAFE_HI)) | big);
}

// One step up (nextafter(x, +inf)) of x >= 0 or NaN (+inf and NaN stay), and one step toward 0 of x >= 0 or NaN (0
// stays): bit operations, so that the loops over a block's lanes vectorise (std::nextafter is a libm call).
inline double step_up(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  u = x == 0.0 ? uint64_t(1) : u + 1;  // ±0 -> the smallest subnormal
  double y;
  std::memcpy(&y, &u, sizeof y);
  return x < std::numeric_limits<double>::infinity() ? y : x;
}
inline double step_down(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  u = u - 1;
  double y;
  std::memcpy(&y, &u, sizeof y);
  return x > 0.0 ? y : x;
}

// clipping.py::upper_norms: r (1 + rel) + extra, each operation rounded upward (to nearest, then one step up; 0 stays
// 0). ``one`` = step_up(1 + rel); ``with_extra`` as torch's when ``extra`` is a tensor (a step up before the sum even
// where extra is 0).
inline double upper_norm(double r, double one) {
  const double h = r * one;
  return h > 0.0 ? step_up(h) : h;
}
inline double upper_norm(double r, double one, double extra) {
  const double h = step_up(r * one) + extra;
  return h > 0.0 ? step_up(h) : h;
}

// ‖v‖ of n entries scaled by the largest magnitude m (m·‖v/m‖: no square under- or overflows that matters);
// NaN if an entry is.
inline double vnorm(const double* v, int64_t n) {
  double m = 0.0;
  int nan = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = std::fabs(v[i]);
    nan |= x != x ? 1 : 0;
    m = x > m ? x : m;
  }
  if (nan) return NAN;
  if (m == 0.0 || !(m <= DBL_MAX)) return m;
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double y = v[i] / m;
    s = s + y * y;
  }
  return m * std::sqrt(s);
}

// e with max|v| = f·2^e, f in [0.5, 1) (-4000 for a zero vector; 0 for a non-finite one).
inline int expo(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::fabs(x) > m ? std::fabs(x) : m;
  int e = 0;
  if (!(m <= DBL_MAX)) return 0;
  if (m == 0.0) return -4000;
  std::frexp(m, &e);
  return e;
}

// ‖v · 2^-e‖ (v scaled exactly by a power of two first: no square under- or overflows that matters).
inline double scaled_vnorm(const std::vector<double>& v, int e) {
  std::vector<double> w(v.size());
  for (size_t i = 0; i < v.size(); ++i) w[i] = std::ldexp(v[i], -e);
  return vnorm(w.data(), static_cast<int64_t>(w.size()));
}

// ‖dg a1ᵀ + gp da1ᵀ‖, each factor scaled by a power of two, the larger term's scale taken out, the matrix
// written out and its norm scaled: exact to rounding over the whole float64 range (ghost.py's _layer_norm); and in
// ``width`` ‖dg‖ ‖a1‖ + ‖gp‖ ‖da1‖, the scale of its rounding error (ghost.py's norm_bounds).
inline double rank_two_norm(const std::vector<double>& dg, const std::vector<double>& a1,
                            const std::vector<double>& gp, const std::vector<double>& da1, double& width) {
  const int e_dg = expo(dg), e_a = expo(a1), e_gp = expo(gp), e_da = expo(da1);
  const int top = std::max(e_dg + e_a, e_gp + e_da);
  const double f1 = std::ldexp(1.0, e_dg + e_a - top), f2 = std::ldexp(1.0, e_gp + e_da - top);
  std::vector<double> mat(dg.size() * a1.size());
  for (size_t o = 0; o < dg.size(); ++o) {
    const double u = std::ldexp(dg[o], -e_dg) * f1, v = std::ldexp(gp[o], -e_gp) * f2;
    for (size_t h = 0; h < a1.size(); ++h)
      mat[o * a1.size() + h] = u * std::ldexp(a1[h], -e_a) + v * std::ldexp(da1[h], -e_da);
  }
  width = std::ldexp(scaled_vnorm(dg, e_dg) * scaled_vnorm(a1, e_a), e_dg + e_a) +
          std::ldexp(scaled_vnorm(gp, e_gp) * scaled_vnorm(da1, e_da), e_gp + e_da);
  return std::ldexp(vnorm(mat.data(), static_cast<int64_t>(mat.size())), top);
}

// ------------------------------------------------------------------------------------------ the forward pass
// Elementary functions for the forward pass, in IEEE operations only (no libm call, no FMA), so that a block's
// loops vectorise and every lane's bits are the same whatever the vector width. Arguments of exp and expm1 are
// ≤ 0 (every use below: exp(-|h|), exp(-2|h|), exp(z - max z)) or NaN; log1p's are in [0, 1] or NaN; log's ≥ 1.
//   exp(x) = 2^k (1 + p(r)), expm1(x) = 2^k p(r) + (2^k - 1), x = k ln 2 + r, |r| ≤ ln 2 / 2 (Cody and Waite:
//   k ln2_hi exact), p(r) = expm1(r) by its Taylor polynomial (degree 13 in double, 7 in float: truncation below
//   the dtype's epsilon / 8; evaluated by Estrin's scheme, ``poly``); 2^k from the bits of x·log2(e) + 1.5·2^mant (round to nearest), in two steps where
//   2^k is subnormal.
//   log1p(t) = [t > √2 - 1] ln 2 + 2 atanh(f / (2 + f)), f = t or (t - 1) / 2: |f/(2+f)| ≤ 0.172, the atanh
//   series to the dtype's epsilon / 8 (11 terms in double, 5 in float); log(s) = e ln 2 + log1p(m - 1), s = 2^e m.
// Errors: a few units in the last place (a test compares them with float64 / mpmath references); the torch path's
// SLEEF functions differ from them by as much: the fused forward is equal to torch's to rounding, not in bits.
template <typename T> struct Elem;
template <> struct Elem<double> {
  using U = uint64_t;
  static constexpr int MANT = 52;
  static constexpr int64_t BIAS = 1023;
  static constexpr double LOG2E = 0x1.71547652b82fep0, LN2HI = 0x1.62e42fee00000p-1, LN2LO = 0x1.a39ef35793c76p-33,
                          LN2 = 0x1.62e42fefa39efp-1, SHIFT = 0x1.8p52, LOWEST = -1100.0, FAR = -1000.0,
                          LIFT = 600.0, POST = 0x1p-600, SQRT2M1 = 0x1.a827999fcef34p-2;
  // expm1(r) = r (1 + r (c[0] + r (c[1] + ...))): 1/2!, ..., 1/13!
  static constexpr double EXPM1[] = {1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320,
                                     1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600,
                                     1.0 / 6227020800.0};
  // 2 atanh(s) = 2 s + s z (c[0] + z (c[1] + ...)), z = s²: 2/3, 2/5, ..., 2/23
  static constexpr double ATANH[] = {2.0 / 3, 2.0 / 5, 2.0 / 7, 2.0 / 9, 2.0 / 11, 2.0 / 13, 2.0 / 15, 2.0 / 17,
                                     2.0 / 19, 2.0 / 21, 2.0 / 23};
};
template <> struct Elem<float> {
  using U = uint32_t;
  static constexpr int MANT = 23;
  static constexpr int64_t BIAS = 127;
  static constexpr float LOG2E = 0x1.715476p0f, LN2HI = 0x1.62ep-1f, LN2LO = 0x1.0bfbe8p-15f, LN2 = 0x1.62e43p-1f,
                         SHIFT = 0x1.8p23f, LOWEST = -120.0f, FAR = -100.0f, LIFT = 50.0f, POST = 0x1p-50f,
                         SQRT2M1 = 0x1.a8279ap-2f;
  static constexpr float EXPM1[] = {1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
  static constexpr float ATANH[] = {2.0f / 3, 2.0f / 5, 2.0f / 7, 2.0f / 9, 2.0f / 11};
};

// c[0] + z c[1] + ... + z^(N - 1) c[N - 1] by Estrin's scheme, written out at compile time (a loop here keeps GCC
// from vectorising the loop over lanes around it): the two halves side by side, joined by a power z^(2^k) (``zp`` =
// z, z², z⁴, z⁸), a dependency chain of about 2 log2 N operations where Horner's is 2 N. A lane's chain, not the
// arithmetic, bounds the activations' speed (one block's loop holds one or two vectors): measured 26 % less time
// for float64 softplus than Horner, 10 % for float32; the same accuracy (tests/test_fused.py).
template <size_t I, size_t L, typename T, size_t N>
inline T estrin_part(const T (&c)[N], const T* zp) {
  if constexpr (L == 1) {
    return c[I];
  } else if constexpr (L == 2) {
    return c[I] + zp[0] * c[I + 1];
  } else {
    constexpr size_t m = L > 8 ? 8 : (L > 4 ? 4 : 2);
    constexpr size_t k = m == 8 ? 3 : (m == 4 ? 2 : 1);
    return estrin_part<I, m>(c, zp) + zp[k] * estrin_part<I + m, L - m>(c, zp);
  }
}
template <typename T, size_t N>
inline T poly(const T (&c)[N], T z) {
  static_assert(N <= 16, "poly: up to 16 coefficients (z⁸ is the largest power taken)");
  T zp[4];
  zp[0] = z;
  zp[1] = z * z;
  zp[2] = zp[1] * zp[1];
  zp[3] = zp[2] * zp[2];
  return estrin_part<0, N>(c, zp);
}

template <typename T>
inline T bits_to(typename Elem<T>::U u) { T v; std::memcpy(&v, &u, sizeof v); return v; }
template <typename T>
inline typename Elem<T>::U to_bits(T v) { typename Elem<T>::U u; std::memcpy(&u, &v, sizeof u); return u; }

// For x ≤ 0 (or NaN): pm1 = expm1(r) and the scale 2^k (k ≥ FAR), x = k ln 2 + r; ``post`` = 1, or POST where
// k < FAR (then exp(x) = (2^(k + LIFT) (1 + pm1)) POST).
template <typename T>
inline void exp_parts(T x, T& pm1, T& scale, T& post) {
  using E = Elem<T>;
  using U = typename E::U;
  x = x < E::LOWEST ? E::LOWEST : x;  // NaN stays NaN
  const T t = x * E::LOG2E + E::SHIFT;
  const T kd = t - E::SHIFT;
  const T r = (x - kd * E::LN2HI) - kd * E::LN2LO;
  pm1 = r + r * (r * poly(E::EXPM1, r));
  const bool far = kd < E::FAR;
  // the bits of t are those of SHIFT plus k: 2^k's exponent field is k + BIAS
  const U k = to_bits(t) - to_bits(E::SHIFT) + (far ? static_cast<U>(static_cast<int64_t>(E::LIFT)) : U(0));
  scale = bits_to<T>(static_cast<U>(k + static_cast<U>(E::BIAS)) << E::MANT);
  post = far ? E::POST : T(1);
}

template <typename T>
inline T exp_neg(T x) {  // exp(x), x ≤ 0
  T pm1, scale, post;
  exp_parts(x, pm1, scale, post);
  return (scale * (T(1) + pm1)) * post;
}

template <typename T>
inline T expm1_neg(T x) {  // expm1(x), x ≤ 0: where k < FAR the result is -1 to rounding (post dropped)
  T pm1, scale, post;
  exp_parts(x, pm1, scale, post);
  return scale * pm1 + (scale - T(1));
}

template <typename T>
inline T log1p_unit(T t) {  // log1p(t), t in [0, 1]
  using E = Elem<T>;
  const bool big = t > E::SQRT2M1;
  const T f = big ? (t - T(1)) * T(0.5) : t;
  const T s = f / (T(2) + f);
  const T z = s * s;
  return (big ? E::LN2 : T(0)) + (T(2) * s + s * (z * poly(E::ATANH, z)));
}

template <typename T>
inline T log_ge1(T v) {  // log(v), v ≥ 1 (finite)
  using E = Elem<T>;
  using U = typename E::U;
  const U u = to_bits(v);
  const U e = (u >> E::MANT) - static_cast<U>(E::BIAS);  // v = 2^e m, m in [1, 2)
  const T m = bits_to<T>(u - (e << E::MANT));
  const T f = m - T(1);  // exact, in [0, 1)
  return static_cast<T>(static_cast<std::make_signed_t<U>>(e)) * E::LN2 + log1p_unit(f);
}

// ------------------------------------------------------------------------------ packs of native vectors
// The forward pass's loops written over packs: K vectors of the build's native width (64 bytes with AVX-512, 32 with
// AVX, 16 on the x86-64 baseline), each operation applied to the K vectors one after another. A lane's operations are
// the scalar code's above, in the same order (one IEEE operation each, selects as selects): the same bits lane by lane
// whatever K and the width (tests compare the baseline build's bits with this machine's). What packs change is the
// schedule: a block's activations are one long dependency chain per vector (exp, then log1p's division, then φ'), and
// with one vector per loop iteration the out-of-order window holds about two of them; K independent chains side by side
// keep the units busy (measured: float32 softplus 0.70 of the per-row loop's time at K = 10). (GCC's generic vectors
// wider than the native ones are not used: it lowers their selects and comparisons lane by lane.)
#if defined(__AVX512F__)
constexpr int NATIVE = 64;
#elif defined(__AVX__)
constexpr int NATIVE = 32;
#else
constexpr int NATIVE = 16;
#endif
template <typename T> struct Nat;
template <> struct Nat<float> {
  typedef float V __attribute__((vector_size(NATIVE)));
  typedef int32_t M __attribute__((vector_size(NATIVE)));
  typedef uint32_t U __attribute__((vector_size(NATIVE)));
};
template <> struct Nat<double> {
  typedef double V __attribute__((vector_size(NATIVE)));
  typedef int64_t M __attribute__((vector_size(NATIVE)));
  typedef uint64_t U __attribute__((vector_size(NATIVE)));
};
#define PK_EACH _Pragma("GCC unroll 16") for (int i = 0; i < K; ++i)
#define PK_INLINE inline __attribute__((always_inline))
template <typename T, int K> struct PkM { typename Nat<T>::M v[K]; };  // per lane: -1 (true) or 0
template <typename T, int K> struct PkU { typename Nat<T>::U v[K]; };  // a lane's bits
template <typename T, int K> struct Pk {
  using V = typename Nat<T>::V;
  static constexpr int64_t L = NATIVE / sizeof(T);  // lanes of a native vector
  static constexpr int64_t LANES = K * L;
  V v[K];
  static PK_INLINE Pk splat(T s) {
    Pk r;
    PK_EACH for (int64_t j = 0; j < L; ++j) r.v[i][j] = s;
    return r;
  }
  static PK_INLINE Pk load(const T* p) { Pk r; std::memcpy(r.v, p, sizeof r.v); return r; }
  PK_INLINE void store(T* p) const { std::memcpy(p, v, sizeof v); }
};
#define PK_BINARY(OP)                                                                                            \
  template <typename T, int K> PK_INLINE Pk<T, K> operator OP(const Pk<T, K>& a, const Pk<T, K>& b) {            \
    Pk<T, K> r; PK_EACH r.v[i] = a.v[i] OP b.v[i]; return r;                                                     \
  }                                                                                                               \
  template <typename T, int K> PK_INLINE Pk<T, K> operator OP(const Pk<T, K>& a, T b) {                           \
    Pk<T, K> r; PK_EACH r.v[i] = a.v[i] OP b; return r;                                                          \
  }                                                                                                               \
  template <typename T, int K> PK_INLINE Pk<T, K> operator OP(T a, const Pk<T, K>& b) {                           \
    Pk<T, K> r; PK_EACH r.v[i] = a OP b.v[i]; return r;                                                          \
  }
PK_BINARY(+)
PK_BINARY(-)
PK_BINARY(*)
PK_BINARY(/)
template <typename T, int K> PK_INLINE Pk<T, K> operator-(const Pk<T, K>& a) { Pk<T, K> r; PK_EACH r.v[i] = -a.v[i]; return r; }
#define PK_COMPARE(NAME, OP)                                                                                     \
  template <typename T, int K> PK_INLINE PkM<T, K> NAME(const Pk<T, K>& a, T b) {                                 \
    PkM<T, K> r; PK_EACH r.v[i] = a.v[i] OP b; return r;                                                         \
  }
PK_COMPARE(lt, <)
PK_COMPARE(gt, >)
PK_COMPARE(ge, >=)
template <typename T, int K> PK_INLINE Pk<T, K> sel(const PkM<T, K>& m, const Pk<T, K>& a, const Pk<T, K>& b) {
  Pk<T, K> r; PK_EACH r.v[i] = m.v[i] ? a.v[i] : b.v[i]; return r;
}
template <typename T, int K> PK_INLINE PkU<T, K> sel(const PkM<T, K>& m, const PkU<T, K>& a, const PkU<T, K>& b) {
  PkU<T, K> r; PK_EACH r.v[i] = m.v[i] ? a.v[i] : b.v[i]; return r;
}
template <typename T, int K> PK_INLINE Pk<T, K> pk_fabs(const Pk<T, K>& a) {  // the sign bit cleared, as std::fabs
  using U = typename Nat<T>::U;
  const U keep = ~(U)Pk<T, 1>::splat(T(-0.0)).v[0];
  Pk<T, K> r; PK_EACH r.v[i] = (typename Nat<T>::V)((U)a.v[i] & keep); return r;
}
template <typename T, int K> PK_INLINE PkU<T, K> pk_splat_bits(typename Elem<T>::U s) {
  PkU<T, K> r; PK_EACH for (int64_t j = 0; j < Pk<T, K>::L; ++j) r.v[i][j] = s; return r;
}

// Two float32 vectors of half the native width side by side, as one native vector (the lanes of lo, then hi's).
typedef float HalfF __attribute__((vector_size(NATIVE / 2)));
template <size_t... I>
PK_INLINE typename Nat<float>::V join_lanes(HalfF lo, HalfF hi, std::index_sequence<I...>) {
  return __builtin_shufflevector(lo, hi, I...);
}
PK_INLINE typename Nat<float>::V join(HalfF lo, HalfF hi) {
  return join_lanes(lo, hi, std::make_index_sequence<NATIVE / 4>{});
}

template <size_t I, size_t L, typename T, size_t N, int K>
PK_INLINE Pk<T, K> pk_estrin_part(const T (&c)[N], const Pk<T, K>* zp) {  // estrin_part's operations
  if constexpr (L == 1) {
    return Pk<T, K>::splat(c[I]);
  } else if constexpr (L == 2) {
    return c[I] + zp[0] * c[I + 1];
  } else {
    constexpr size_t m = L > 8 ? 8 : (L > 4 ? 4 : 2);
    constexpr size_t k = m == 8 ? 3 : (m == 4 ? 2 : 1);
    return pk_estrin_part<I, m>(c, zp) + zp[k] * pk_estrin_part<I + m, L - m>(c, zp);
  }
}
template <typename T, size_t N, int K>
PK_INLINE Pk<T, K> pk_poly(const T (&c)[N], const Pk<T, K>& z) {
  Pk<T, K> zp[4];
  zp[0] = z;
  zp[1] = z * z;
  zp[2] = zp[1] * zp[1];
  zp[3] = zp[2] * zp[2];
  return pk_estrin_part<0, N>(c, zp);
}
template <typename T, int K>  // exp_parts
PK_INLINE void pk_exp_parts(Pk<T, K> x, Pk<T, K>& pm1, Pk<T, K>& scale, Pk<T, K>& post) {
  using E = Elem<T>;
  using P = Pk<T, K>;
  using SU = typename E::U;
  x = sel(lt(x, E::LOWEST), P::splat(E::LOWEST), x);  // NaN stays NaN
  const P t = x * E::LOG2E + E::SHIFT;
  const P kd = t - E::SHIFT;
  const P r = (x - kd * E::LN2HI) - kd * E::LN2LO;
  pm1 = r + r * (r * pk_poly(E::EXPM1, r));
  const PkM<T, K> far = lt(kd, E::FAR);
  const PkU<T, K> lift = sel(far, pk_splat_bits<T, K>(static_cast<SU>(static_cast<int64_t>(E::LIFT))),
                             pk_splat_bits<T, K>(SU(0)));
  PkU<T, K> k;
  PK_EACH k.v[i] = (typename Nat<T>::U)t.v[i] - to_bits(E::SHIFT) + lift.v[i];
  PK_EACH scale.v[i] = (typename Nat<T>::V)((k.v[i] + static_cast<SU>(E::BIAS)) << E::MANT);
  post = sel(far, P::splat(E::POST), P::splat(T(1)));
}
template <typename T, int K>
PK_INLINE Pk<T, K> pk_exp_neg(const Pk<T, K>& x) {
  Pk<T, K> pm1, scale, post;
  pk_exp_parts(x, pm1, scale, post);
  return (scale * (T(1) + pm1)) * post;
}
template <typename T, int K>
PK_INLINE Pk<T, K> pk_expm1_neg(const Pk<T, K>& x) {
  Pk<T, K> pm1, scale, post;
  pk_exp_parts(x, pm1, scale, post);
  return scale * pm1 + (scale - T(1));
}
template <typename T, int K>
PK_INLINE Pk<T, K> pk_log1p_unit(const Pk<T, K>& t) {
  using E = Elem<T>;
  using P = Pk<T, K>;
  const PkM<T, K> big = gt(t, E::SQRT2M1);
  const P f = sel(big, (t - T(1)) * T(0.5), t);
  const P s = f / (T(2) + f);
  const P z = s * s;
  return sel(big, P::splat(E::LN2), P::splat(T(0))) + (T(2) * s + s * (z * pk_poly(E::ATANH, z)));
}

//: Activation codes (core/fused.py's ACTIVATION_CODES).
enum Activation : int { SOFTPLUS = 0, TANH = 1, SIGMOID = 2, RELU = 3, IDENTITY = 4 };
enum Loss : int { HALF_SQUARED_ERROR = 0, CROSS_ENTROPY = 1 };

// φ(h) and φ'(h) of a pack (K native vectors of h at hp, to a and d), each derivative as torch's autograd takes it
// (ghost.py's ACTIVATIONS): softplus (beta 1, threshold 20) max(h, 0) + log1p(exp(-|h|)), φ' = 1 / (1 + t) or t / (1 +
// t); tanh = -expm1(-2|h|) / (2 + expm1(-2|h|)) with h's sign, φ' = 1 - tanh²; sigmoid 1 / (1 + t) or t / (1 + t), φ'
// = s (1 - s); relu (φ' = 0 at 0); identity.
template <typename T, int K>
PK_INLINE void pk_activate(int act, const T* hp, T* a, T* d) {
  using P = Pk<T, K>;
  const P h = P::load(hp);
  const P zero = P::splat(T(0)), one = P::splat(T(1));
  switch (act) {
    case SOFTPLUS: {
      const P t = pk_exp_neg(-pk_fabs(h));
      const PkM<T, K> linear = gt(h, T(20));
      sel(linear, h, sel(gt(h, T(0)), h, zero) + pk_log1p_unit(t)).store(a);
      // one division: h ≥ 0 ? 1 / (1 + t) : t / (1 + t), its numerator chosen first
      sel(linear, one, sel(ge(h, T(0)), one, t) / (T(1) + t)).store(d);
      break;
    }
    case TANH: {
      const P em = pk_expm1_neg(T(-2) * pk_fabs(h));
      const P m = -em / (T(2) + em);
      const P v = sel(lt(h, T(0)), -m, m);
      v.store(a);
      (T(1) - v * v).store(d);
      break;
    }
    case SIGMOID: {
      const P t = pk_exp_neg(-pk_fabs(h));
      const P s = sel(ge(h, T(0)), one, t) / (T(1) + t);
      s.store(a);
      (s * (T(1) - s)).store(d);
      break;
    }
    case RELU:
      sel(lt(h, T(0)), zero, h).store(a);  // NaN stays NaN
      sel(gt(h, T(0)), one, zero).store(d);
      break;
    default:  // IDENTITY
      h.store(a);
      one.store(d);
  }
}

// pk_activate over n values (n a multiple of the native width, the vectors V = n / L): packs of at most 8 vectors,
// as even as they go (10 vectors: 5 + 5, not 8 + 2: a short pack's chains wait as the per-row loop's do).
template <typename T, int K>
__attribute__((noinline)) void activate_pack(int act, const T* hp, T* a, T* d) { pk_activate<T, K>(act, hp, a, d); }
template <typename T>
inline void activate_n(int act, const T* hp, T* a, T* d, int64_t n) {
  constexpr int64_t L = Pk<T, 1>::L;
  const int64_t vectors = n / L, packs = (vectors + 7) / 8;
  int64_t i = 0;
  for (int64_t p = 0; p < packs; ++p) {
    const int64_t k = (vectors - i / L) / (packs - p);  // this pack's vectors: the rest over the packs left
    switch (k) {
      case 8: activate_pack<T, 8>(act, hp + i, a + i, d + i); break;
      case 7: activate_pack<T, 7>(act, hp + i, a + i, d + i); break;
      case 6: activate_pack<T, 6>(act, hp + i, a + i, d + i); break;
      case 5: activate_pack<T, 5>(act, hp + i, a + i, d + i); break;
      case 4: activate_pack<T, 4>(act, hp + i, a + i, d + i); break;
      case 3: activate_pack<T, 3>(act, hp + i, a + i, d + i); break;
      case 2: activate_pack<T, 2>(act, hp + i, a + i, d + i); break;
      default: activate_pack<T, 1>(act, hp + i, a + i, d + i);
    }
    i += k * L;
  }
}

// out = w · in + b for C rows of a block: row c's n weights w[c n ..], in's n rows ``stride`` apart (the sum over them
// in order, from w_0 in_0, then the bias), out's rows BLOCK apart; the C · BLOCK accumulators in registers.
template <typename T, int C>
inline void affine_pack(const T* w, int64_t n, const T* in, int64_t stride, const T* b, T* out) {
  using V = typename Nat<T>::V;
  constexpr int64_t L = Pk<T, 1>::L, R = BLOCK / L;
  V acc[C][R];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    V x;
    std::memcpy(&x, in + r * L, sizeof x);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c][r] = w[c * n] * x;
  }
  for (int64_t i = 1; i < n; ++i) {
    const T* row = in + i * stride;
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      V x;
      std::memcpy(&x, row + r * L, sizeof x);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[c][r] = acc[c][r] + w[c * n + i] * x;
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const V v = acc[c][r] + b[c];
      std::memcpy(out + c * BLOCK + r * L, &v, sizeof v);
    }
}

// affine_pack for ``rows`` rows (out's rows BLOCK apart): up to 8 native vectors of accumulators at a time.
template <typename T>
inline void affine_rows(const T* w, int64_t rows, int64_t n, const T* in, int64_t stride, const T* b, T* out) {
  constexpr int R = static_cast<int>(BLOCK / Pk<T, 1>::L), C = R >= 8 ? 1 : 8 / R;
  int64_t r = 0;
  for (; r + C <= rows; r += C) affine_pack<T, C>(w + r * n, n, in, stride, b + r, out + r * BLOCK);
  if constexpr (C > 2)
    for (; r + 2 <= rows; r += 2) affine_pack<T, 2>(w + r * n, n, in, stride, b + r, out + r * BLOCK);
  for (; r < rows; ++r) affine_pack<T, 1>(w + r * n, n, in, stride, b + r, out + r * BLOCK);
}

// The forward pass of one block of one run: h = W_1 x + b_1 (the sum over features in order, then the bias),
// a = φ(h), φ'(h), z = W_2 a + b_2, and g_L = ∂ℓ/∂z, ℓ (ghost.py's _output_gradient: z - y and ½ e e; or
// exp(log_softmax(z)) - onehot(y) and -log_softmax(z)[y]). ``par``: the run's parameters (W_1, b_1, W_2, b_2),
// ``xt`` [F] rows ``sx`` apart, outputs a, φ' [H] and g_L [O] rows ``s`` apart, ℓ [1]; ``z`` [O, BLOCK] and ``hb``
// [H, BLOCK] work.
template <typename T>
void forward_block(const T* par, int64_t H, int64_t O, int64_t F, int act, int loss, const T* xt, int64_t sx,
                   const T* y, T* a, T* dphi, T* gl, T* ls, int64_t s, T* z, T* hb) {
  const T *w1 = par, *b1 = par + H * F, *w2 = b1 + H, *b2 = w2 + O * H;
  affine_rows(w1, H, F, xt, sx, b1, hb);  // every unit's h first: the activations then run over packs
  if (s == BLOCK) {
    activate_n(act, hb, a, dphi, H * BLOCK);
  } else {
    for (int64_t h = 0; h < H; ++h) activate_n(act, hb + h * BLOCK, a + h * s, dphi + h * s, BLOCK);
  }
  affine_rows(w2, O, H, a, s, b2, z);
  if (loss == HALF_SQUARED_ERROR) {
    for (int64_t j = 0; j < BLOCK; ++j) {
      const T e = z[j] - y[j];
      gl[j] = e;
      ls[j] = T(0.5) * e * e;
    }
    return;
  }
  T m[BLOCK], sum[BLOCK], lse[BLOCK], zy[BLOCK];
  for (int64_t j = 0; j < BLOCK; ++j) m[j] = z[j];
  for (int64_t o = 1; o < O; ++o)
    for (int64_t j = 0; j < BLOCK; ++j) m[j] = z[o * BLOCK + j] > m[j] ? z[o * BLOCK + j] : m[j];
  for (int64_t j = 0; j < BLOCK; ++j) sum[j] = T(0);
  for (int64_t o = 0; o < O; ++o)
    for (int64_t j = 0; j < BLOCK; ++j) sum[j] = sum[j] + exp_neg(z[o * BLOCK + j] - m[j]);
  for (int64_t j = 0; j < BLOCK; ++j) lse[j] = sum[j] >= T(1) && sum[j] <= std::numeric_limits<T>::max()
                                                   ? log_ge1(sum[j]) : std::numeric_limits<T>::quiet_NaN();
  for (int64_t j = 0; j < BLOCK; ++j) zy[j] = T(0);
  for (int64_t o = 0; o < O; ++o) {
    T* g = gl + o * s;
    for (int64_t j = 0; j < BLOCK; ++j) {
      const T lp = (z[o * BLOCK + j] - m[j]) - lse[j];
      const bool hit = y[j] == static_cast<T>(o);
      g[j] = exp_neg(lp) - (hit ? T(1) : T(0));
      zy[j] = hit ? lp : zy[j];
    }
  }
  for (int64_t j = 0; j < BLOCK; ++j) ls[j] = -zy[j];
}

// ------------------------------------------------------------------- float32 block products (W_1, many features)
// prod [H, fpad] = cd [H, b] @ x [b, fpad] in float32, each entry Σ_j cd[h, j] x[j, f] added in the order j = 0 .. b - 1
// from 0 (one IEEE product and one sum per term: no FMA, -ffp-contract=off), whatever the tiling: the same bits on
// any instruction set, and a run's rows do not depend on the other runs. Tiles of 2 rows × 64 columns (8 vectors of
// 16 floats, in registers), then 16-column and single-row remainders; fpad a multiple of 16.
typedef float v16f __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

// (The loops over r and c are unrolled by the pragmas, whatever max-completely-peel-times says: the accumulators stay
// in registers.)
template <int R, int C>
inline void product_tile(const float* cd, const float* x, int64_t b, int64_t fpad, float* out) {
  v16f acc[R][C];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = v16f{};
  for (int64_t j = 0; j < b; ++j) {
    const float* xj = x + j * fpad;
    v16f xv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) xv[c] = *reinterpret_cast<const v16u*>(xj + 16 * c);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const float w = cd[r * b + j];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = acc[r][c] + w * xv[c];
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) *reinterpret_cast<v16u*>(out + r * fpad + 16 * c) = acc[r][c];
}

inline void block_product(const float* cd, const float* x, int64_t H, int64_t b, int64_t fpad, float* out) {
  int64_t h = 0;
  for (; h + 2 <= H; h += 2) {
    int64_t f = 0;
    for (; f + 64 <= fpad; f += 64) product_tile<2, 4>(cd + h * b, x + f, b, fpad, out + h * fpad + f);
    for (; f < fpad; f += 16) product_tile<2, 1>(cd + h * b, x + f, b, fpad, out + h * fpad + f);
  }
  for (; h < H; ++h) {
    int64_t f = 0;
    for (; f + 64 <= fpad; f += 64) product_tile<1, 4>(cd + h * b, x + f, b, fpad, out + h * fpad + f);
    for (; f < fpad; f += 16) product_tile<1, 1>(cd + h * b, x + f, b, fpad, out + h * fpad + f);
  }
}

template <typename T>
struct Kernel {
  int64_t H, O, F;
  const T *w2, *w2p;  // [O, H] of this run, at x and x'
  double rad;
  double* acc;        // [d, BLOCK]: W_1 (H·F), b_1 (H), W_2 (O·H), b_2 (O), one lane per sample of a block
  double *dg1, *av, *dav, *dgl, *gpl;  // [H, BLOCK], [H, BLOCK], [H, BLOCK], [O, BLOCK], [O, BLOCK]
  double* cd1 = nullptr;  // if set: c dg_1 of the block goes here (rows cd1s apart) instead of into W_1
  int64_t cd1s = 0;
  // κ of ghost.py's norm_bounds (norm_error, scaled_norm_error: passed in by fused.py) and step_up(1 + κ) of each
  double kappa = 0.0, kappa_s = 0.0, one = 1.0, one_s = 1.0;
  double* factors = nullptr;  // if set: the block's clip factors c go here (BLOCK lanes; for inspection)
  // Float32 windows (fused.py's accumulate="float32"; T = float only): the clipped terms, times the run's power of
  // two ``scale`` (S·C' in [2^62, 2^63): nothing that matters underflows in float32, nothing overflows), go into the
  // float32 lane partials ``accf`` [d, BLOCK] of the current window, which fused() adds into ``acc`` (divided by S,
  // exactly) every ``flush`` blocks; with ``cd1f`` set, c·S·dg_1 goes there as float32 (rows cd1s apart) instead of
  // into W_1. W_1's lane terms wait for up to PENDING blocks: ``xb`` [PENDING, F, BLOCK] their inputs as float32 and
  // ``pcf`` [PENDING, H, BLOCK] their fl32(c S dg_1), ``pending`` of them; drain() adds them to the partials, block by
  // block in order: each lane's partial takes the same terms in the same order as one block at a time (the same bits),
  // and is loaded and stored once per PENDING blocks (fused() drains before a window's partials are read).
  static constexpr int64_t PENDING = 4;
  float* accf = nullptr;
  double scale = 1.0;
  float* cd1f = nullptr;
  float* xb = nullptr;
  float* pcf = nullptr;
  int64_t pending = 0;

  // W_1's waiting terms into the float32 partials (see xb): per (h, f) and lane, w + t_0 + t_1 + ... in block order.
  template <int NB>
  inline void drain_n() {
    using FV = typename Nat<float>::V;
    constexpr int64_t L = NATIVE / 4, R = BLOCK / L;
    const auto ld = [](const float* p) { FV v; std::memcpy(&v, p, sizeof v); return v; };
    const int64_t H = this->H, F = this->F;
    const float *const pc = pcf, *const xs = xb;
    float* const w1 = accf;
    for (int64_t h = 0; h < H; ++h) {
      FV cf[NB][R];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b)
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) cf[b][r] = ld(pc + (b * H + h) * BLOCK + r * L);
      for (int64_t f = 0; f < F; ++f) {
        float* w = w1 + (h * F + f) * BLOCK;
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          FV v = ld(w + r * L);
#pragma GCC unroll 4
          for (int b = 0; b < NB; ++b) v = v + cf[b][r] * ld(xs + (b * F + f) * BLOCK + r * L);
          std::memcpy(w + r * L, &v, sizeof v);
        }
      }
    }
  }
  void drain() {
    switch (pending) {
      case 4: drain_n<4>(); break;
      case 3: drain_n<3>(); break;
      case 2: drain_n<2>(); break;
      case 1: drain_n<1>(); break;
      default: break;
    }
    pending = 0;
  }

  // (Not inlined, as scaled_norm: the hot loop of block() stays as lean as without them, measured 20 % faster.)
  // The bracket ‖dg_L ãᵀ + g_L' (da, 0)ᵀ‖² from the QR factorisation of [ã, (da, 0)] (ghost.py's docstring):
  // ‖s² dg_L + p g_L'‖² / s² + (‖da - μ a‖² + μ²) ‖g_L'‖², s² = 1 + ‖a‖², p = a·da, μ = p / s², into t1 where
  // A + B (``ab``) > 16 t1, and its bound (√qr (1 + κ) + κ (√A + 4 √B))² into hi (ghost.py's norm_bounds). Reads the
  // block's dg_L, g_L', a, da.
  __attribute__((noinline)) void qr_terms(const double* sa, const double* sada, const double* sgp, const double* sdgl,
                                          const double* sda, const double* ab, double* t1, double* hi) const {
    double s2[BLOCK], mu[BLOCK], se[BLOCK], sw[BLOCK];
    for (int64_t j = 0; j < BLOCK; ++j) { s2[j] = 1.0 + sa[j]; mu[j] = sada[j] / s2[j]; se[j] = 0.0; sw[j] = 0.0; }
    for (int64_t o = 0; o < O; ++o) {
      const double* dv = dgl + o * BLOCK;
      const double* pv = gpl + o * BLOCK;
      for (int64_t j = 0; j < BLOCK; ++j) {
        const double e = s2[j] * dv[j] + sada[j] * pv[j];
        se[j] = se[j] + e * e;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const double* ah = av + h * BLOCK;
      const double* dah = dav + h * BLOCK;
      for (int64_t j = 0; j < BLOCK; ++j) {
        const double w = dah[j] - mu[j] * ah[j];
        sw[j] = sw[j] + w * w;
      }
    }
    for (int64_t j = 0; j < BLOCK; ++j) {
      const double qr = se[j] / s2[j] + (sw[j] + mu[j] * mu[j]) * sgp[j];
      const double root = std::sqrt(qr) * (1.0 + kappa) +
                          kappa * (std::sqrt(sdgl[j] * (1.0 + sa[j])) + 4.0 * std::sqrt(sgp[j] * sda[j]));
      const bool cancel = ab[j] > CANCELLATION * t1[j];
      hi[j] = cancel ? root * root : hi[j];
      t1[j] = cancel ? qr : t1[j];
    }
  }

  // The lane's norm with every factor scaled by a power of two and the rank-two matrix written out (slow, for
  // the rare lanes that need it): ghost.py's _scaled_norms; and in ``width`` the scale of its rounding error (the
  // output layer's, rank two; 0 for a plain row, whose layers are rank one).
  __attribute__((noinline)) double scaled_norm(const Block<T>& in, int64_t j, bool diff, double& width) const {
    std::vector<double> x1(F + 1, 1.0), g1(H), a1(H + 1, 1.0), gl(O), gp(O), da1(H + 1, 0.0);
    for (int64_t f = 0; f < F; ++f) x1[f] = in.x[f * in.sx + j];
    for (int64_t h = 0; h < H; ++h) {
      g1[h] = dg1[h * BLOCK + j];
      a1[h] = av[h * BLOCK + j];
      if (diff) da1[h] = dav[h * BLOCK + j];
    }
    for (int64_t o = 0; o < O; ++o) { gl[o] = dgl[o * BLOCK + j]; gp[o] = diff ? gpl[o * BLOCK + j] : 0.0; }
    const double first = vnorm(g1.data(), H) * vnorm(x1.data(), F + 1);
    width = 0.0;
    const double last =
        diff ? rank_two_norm(gl, a1, gp, da1, width) : vnorm(gl.data(), O) * vnorm(a1.data(), H + 1);
    return std::hypot(first, last);
  }

  // The float32 window sums of a block (fused.py's docstring, "Float32 accumulation"): c·S (exact: S a power of two)
  // times dg_1, dg_L, g_L' in float64, each rounded to float32 once; W_1's terms fl32(c S dg_1) · fl32(x) in float32;
  // W_2's plain terms fl32(c S dg_L) · a in float32 (a is the float32 input), its difference terms formed in float64
  // (c S dg_L a + c S g_L' da: the two may cancel, float32 would lose the result) and rounded once; each added to its
  // lane's float32 partial. A lane whose input x (given in float64) is beyond float32's range (or NaN) takes W_1's
  // terms in float64 instead, straight into its float64 lane sums: a lane's treatment depends on its own sample only.
  __attribute__((noinline)) void sums_f32(const Block<T>& in, const double* c) {
    if constexpr (std::is_same_v<T, float>) {
      // Native vectors: float64 ones of LD lanes (RD a block), float32 ones of LF lanes (RF a block), each float32
      // vector of a float64 row the conversions of two float64 vectors joined (the scalar casts' values).
      using DV = typename Nat<double>::V;
      using DM = typename Nat<double>::M;
      using DU = typename Nat<double>::U;
      using FV = typename Nat<float>::V;
      typedef float FH __attribute__((vector_size(NATIVE / 2)));
      constexpr int64_t LD = NATIVE / 8, RD = BLOCK / LD, LF = NATIVE / 4, RF = BLOCK / LF;
      const auto ldd = [](const double* p) { DV v; std::memcpy(&v, p, sizeof v); return v; };
      const auto ldf = [](const float* p) { FV v; std::memcpy(&v, p, sizeof v); return v; };
      const auto stf = [](float* p, FV v) { std::memcpy(p, &v, sizeof v); };
      const auto f32 = [](const DV* v, int64_t k) { return join(__builtin_convertvector(v[2 * k], FH),
                                                                 __builtin_convertvector(v[2 * k + 1], FH)); };
      // members in locals: the stores below (memcpy: character type) may alias anything a member pointer reaches
      const int64_t H = this->H, O = this->O, F = this->F, cd1s = this->cd1s;
      float *const xs = this->xb + pending * F * BLOCK, *const cs1 = this->pcf + pending * H * BLOCK;  // this block's slots
      float *const cd1f = this->cd1f, *const accf = this->accf;
      const double *const dgl = this->dgl, *const gpl = this->gpl, *const av = this->av, *const dav = this->dav,
                   *const dg1 = this->dg1;
      const double scale = this->scale;
      const bool diff = in.ap != nullptr;
      int any_far = 0;
      int far[BLOCK];
      if (cd1f == nullptr) {
        const DU magnitude = ~(DU)Pk<double, 1>::splat(-0.0).v[0];
        DM farm[RD];
#pragma GCC unroll 8
        for (int64_t r = 0; r < RD; ++r) farm[r] = DM{};
        for (int64_t f = 0; f < F; ++f) {
          DV x[RD];
#pragma GCC unroll 8
          for (int64_t r = 0; r < RD; ++r) {
            x[r] = ldd(in.x + f * in.sx + r * LD);
            farm[r] |= ~(DM)((DV)((DU)x[r] & magnitude) <= X_F32_MAX);  // !(|x| <= max): NaN too
          }
#pragma GCC unroll 8
          for (int64_t k = 0; k < RF; ++k) stf(xs + f * BLOCK + k * LF, f32(x, k));
        }
        for (int64_t r = 0; r < RD; ++r)
          for (int64_t j = 0; j < LD; ++j) {
            far[r * LD + j] = farm[r][j] != 0 ? 1 : 0;
            any_far |= far[r * LD + j];
          }
        if (any_far)  // those lanes' float32 W_1 terms: 0 (their terms are added in float64 below)
          for (int64_t f = 0; f < F; ++f)
            for (int64_t j = 0; j < BLOCK; ++j) xs[f * BLOCK + j] = far[j] ? 0.0f : xs[f * BLOCK + j];
      }
      float* fb1 = accf + H * F * BLOCK;
      float* fw2 = fb1 + H * BLOCK;
      float* fb2 = fw2 + O * H * BLOCK;
      DV cs[RD], cd[RD], cg[RD], t[RD];
      FV cf[RF];
#pragma GCC unroll 8
      for (int64_t r = 0; r < RD; ++r) cs[r] = ldd(c + r * LD) * scale;
      for (int64_t o = 0; o < O; ++o) {
        float* b2 = fb2 + o * BLOCK;
#pragma GCC unroll 8
        for (int64_t r = 0; r < RD; ++r) cd[r] = ldd(dgl + o * BLOCK + r * LD) * cs[r];
#pragma GCC unroll 8
        for (int64_t k = 0; k < RF; ++k) {
          cf[k] = f32(cd, k);
          stf(b2 + k * LF, ldf(b2 + k * LF) + cf[k]);
        }
        if (diff) {
#pragma GCC unroll 8
          for (int64_t r = 0; r < RD; ++r) cg[r] = ldd(gpl + o * BLOCK + r * LD) * cs[r];
          for (int64_t h = 0; h < H; ++h) {
            float* w = fw2 + (o * H + h) * BLOCK;
#pragma GCC unroll 8
            for (int64_t r = 0; r < RD; ++r)
              t[r] = cd[r] * ldd(av + h * BLOCK + r * LD) + cg[r] * ldd(dav + h * BLOCK + r * LD);
#pragma GCC unroll 8
            for (int64_t k = 0; k < RF; ++k) stf(w + k * LF, ldf(w + k * LF) + f32(t, k));
          }
        } else {
          for (int64_t h = 0; h < H; ++h) {
            float* w = fw2 + (o * H + h) * BLOCK;
            const float* ar = in.a + h * in.s;
#pragma GCC unroll 8
            for (int64_t k = 0; k < RF; ++k) stf(w + k * LF, ldf(w + k * LF) + cf[k] * ldf(ar + k * LF));
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* b1 = fb1 + h * BLOCK;
#pragma GCC unroll 8
        for (int64_t r = 0; r < RD; ++r) t[r] = ldd(dg1 + h * BLOCK + r * LD) * cs[r];
#pragma GCC unroll 8
        for (int64_t k = 0; k < RF; ++k) {
          cf[k] = f32(t, k);
          stf(b1 + k * LF, ldf(b1 + k * LF) + cf[k]);
        }
        if (cd1f != nullptr) {  // W_1's sums are the block products' (many features)
#pragma GCC unroll 8
          for (int64_t k = 0; k < RF; ++k) stf(cd1f + h * cd1s + k * LF, cf[k]);
          continue;
        }
#pragma GCC unroll 8
        for (int64_t k = 0; k < RF; ++k) stf(cs1 + h * BLOCK + k * LF, cf[k]);  // W_1's terms wait (drain)
      }
      if (cd1f == nullptr && ++pending == PENDING) drain();
      if (any_far)  // as the float64 mode, for those lanes (their float32 W_1 terms were c S dg_1 · 0)
        for (int64_t j = 0; j < BLOCK; ++j) {
          if (!far[j]) continue;
          for (int64_t h = 0; h < H; ++h) {
            const double cdj = dg1[h * BLOCK + j] * c[j];
            for (int64_t f = 0; f < F; ++f) {
              double& w = acc[(h * F + f) * BLOCK + j];
              w = w + cdj * in.x[f * in.sx + j];
            }
          }
        }
    }
  }

  // The hidden layer of a block: the backward g_1 = (Σ_o W_2[o, h] g_L[o]) · φ'(h) in T as torch's (the sum over
  // outputs in order, then the product), dg_1 = g_1 - g_1', a, da = a - a' in float64 (into dg1, av, dav) and their
  // squares' sums over the units in order, sdg1 = Σ dg_1², sa = Σ a², sda = Σ da², sada = Σ a da (DIFF; a plain row:
  // dg_1 = g_1, sdg1 and sa only): lane by lane, over native float64 vectors with the block's sums in registers.
  template <bool DIFF>
  inline void hidden(const Block<T>& in, double* sdg1, double* sa, double* sda, double* sada) {
    using DV = typename Nat<double>::V;
    constexpr int64_t L = NATIVE / 8, R = BLOCK / L;  // lanes of a float64 vector, vectors of a block
    typedef T TV __attribute__((vector_size(L * sizeof(T))));  // L lanes of T
    const auto ld = [](const T* p) { TV v; std::memcpy(&v, p, sizeof v); return v; };
    const auto st = [](double* p, DV v) { std::memcpy(p, &v, sizeof v); };
    const int64_t s = in.s, H = this->H, O = this->O;  // locals: the stores (memcpy) may alias members
    const T *const w2 = this->w2, *const w2p = this->w2p;
    double *const dg1 = this->dg1, *const av = this->av, *const dav = this->dav;
    DV q1[R], q2[R], q3[R], q4[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) q1[r] = q2[r] = q3[r] = q4[r] = DV{};  // (H >= 1: the first unit sets them)
    for (int64_t h = 0; h < H; ++h) {
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        const int64_t j = r * L;
        TV g = w2[h] * ld(in.gl + j);
        for (int64_t o = 1; o < O; ++o) g = g + w2[o * H + h] * ld(in.gl + o * s + j);
        g = g * ld(in.dphi + h * s + j);
        DV dg = __builtin_convertvector(g, DV);
        const DV ah = __builtin_convertvector(ld(in.a + h * s + j), DV);
        DV dah;
        if constexpr (DIFF) {
          TV gp = w2p[h] * ld(in.glp + j);
          for (int64_t o = 1; o < O; ++o) gp = gp + w2p[o * H + h] * ld(in.glp + o * s + j);
          gp = gp * ld(in.dphip + h * s + j);
          dg = dg - __builtin_convertvector(gp, DV);
          dah = ah - __builtin_convertvector(ld(in.ap + h * s + j), DV);
          st(dav + h * BLOCK + j, dah);
        }
        st(dg1 + h * BLOCK + j, dg);
        st(av + h * BLOCK + j, ah);
        if (h == 0) {
          q1[r] = dg * dg;
          q2[r] = ah * ah;
          if constexpr (DIFF) { q3[r] = dah * dah; q4[r] = ah * dah; }
        } else {
          q1[r] = q1[r] + dg * dg;
          q2[r] = q2[r] + ah * ah;
          if constexpr (DIFF) { q3[r] = q3[r] + dah * dah; q4[r] = q4[r] + ah * dah; }
        }
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      st(sdg1 + r * L, q1[r]);
      st(sa + r * L, q2[r]);
      if constexpr (DIFF) { st(sda + r * L, q3[r]); st(sada + r * L, q4[r]); }
    }
  }

  // Returns whether a real sample's norm is not finite.
  bool block(const Block<T>& in) {
    const bool diff = in.ap != nullptr;
    const int64_t s = in.s;
    double sdg1[BLOCK], sa[BLOCK], sda[BLOCK], sada[BLOCK], sdgl[BLOCK], sgp[BLOCK], sdgp[BLOCK], c[BLOCK];
    // zero[j]: every output gradient of lane j is exactly 0 (at x, and at x' for a difference row): then g_1 and
    // g_1' are exactly 0 too, the row is exactly zero, and its squares did not underflow (a saturated softmax)
    int zero[BLOCK];
    for (int64_t j = 0; j < BLOCK; ++j) zero[j] = 1;
    // output layer: dg_L = g_L - g_L' (g_L' = 0 for a plain row); the sums over outputs start at the first
    for (int64_t o = 0; o < O; ++o) {
      const T* gr = in.gl + o * s;
      double* dv = dgl + o * BLOCK;
      double* pv = gpl + o * BLOCK;
      if (diff) {
        const T* pr = in.glp + o * s;
        for (int64_t j = 0; j < BLOCK; ++j) {
          const double p = static_cast<double>(pr[j]);
          const double v = static_cast<double>(gr[j]) - p;
          dv[j] = v;
          pv[j] = p;
          zero[j] &= (gr[j] == T(0)) & (pr[j] == T(0));
        }
      } else {
        for (int64_t j = 0; j < BLOCK; ++j) {
          dv[j] = static_cast<double>(gr[j]);
          zero[j] &= gr[j] == T(0);
        }
      }
      if (o == 0) {
        for (int64_t j = 0; j < BLOCK; ++j) sdgl[j] = dv[j] * dv[j];
        if (diff) for (int64_t j = 0; j < BLOCK; ++j) { sgp[j] = pv[j] * pv[j]; sdgp[j] = dv[j] * pv[j]; }
      } else {
        for (int64_t j = 0; j < BLOCK; ++j) sdgl[j] = sdgl[j] + dv[j] * dv[j];
        if (diff) for (int64_t j = 0; j < BLOCK; ++j) { sgp[j] = sgp[j] + pv[j] * pv[j]; sdgp[j] = sdgp[j] + dv[j] * pv[j]; }
      }
    }
    // hidden layer: dg_1 = g_1 - g_1', a, da = a - a' (a' = a for a plain row)
    if (diff)
      hidden<true>(in, sdg1, sa, sda, sada);
    else
      hidden<false>(in, sdg1, sa, sda, sada);
    // ‖∇ℓ(x) - ∇ℓ(x')‖² = ‖dg_1‖²(1 + ‖x‖²) + [‖dg_L‖²(1 + ‖a‖²) + ‖g_L'‖²‖da‖² + 2(dg_L·g_L')(a·da)]
    // (A + B + X); where A + B > 16 (A + B + X) the bracket is taken again from the QR form (qr_terms), and a
    // lane whose squares may have underflowed or overflowed by scaling (scaled_norm): ghost.py's docstring.
    // Beside each norm N̂, an upper bound U of the true norm (ghost.py's norm_bounds, same formulas and κ): per layer
    // its term, A + B + X + κ (A + B + |X|) for the bracket, (√qr (1 + κ) + κ (√A + 4 √B))² where it is taken from the
    // QR form; U = √Σ (1 + κ) rounded up; a lane taken again by scaling: N̂ (1 + κ_s) + κ_s (‖dg_L‖‖ã‖ + ‖g_L'‖‖da‖).
    // c = rad / U rounded and one step toward 0 if U > rad, else 1 (clipping.py's clip_factors: a clipped row's true
    // norm never exceeds rad), times the mask (0 for padding). Branch-free loops: they vectorise; the rare lanes that
    // need more are done over again, each lane's result its own (bits independent of the other lanes of its block).
    const double kap = kappa, one1 = one, radius = rad;  // locals: no aliasing question for the vectoriser
    const double *const sqa = in.sqa, *const mask = in.mask;
    double t1[BLOCK], ab[BLOCK], hi[BLOCK], sq[BLOCK], norm[BLOCK], up[BLOCK];
    if (diff) {
      int cancel = 0;
      for (int64_t j = 0; j < BLOCK; ++j) {
        ab[j] = sdgl[j] * (1.0 + sa[j]) + sgp[j] * sda[j];
        const double x = (2.0 * sdgp[j]) * sada[j];
        t1[j] = ab[j] + x;
        hi[j] = t1[j] + kap * (ab[j] + std::fabs(x));
        cancel |= ab[j] > CANCELLATION * t1[j] ? 1 : 0;
      }
      if (cancel) qr_terms(sa, sada, sgp, sdgl, sda, ab, t1, hi);
    } else {
      for (int64_t j = 0; j < BLOCK; ++j) {
        t1[j] = sdgl[j] * (1.0 + sa[j]);
        hi[j] = t1[j];  // rank one: relative, in the last (1 + κ)
      }
    }
    static constexpr double NONE[BLOCK] = {};  // a plain row's g_L' and da
    const double *const gp2 = diff ? sgp : NONE, *const da2 = diff ? sda : NONE;
    // One loop from the terms to the clip factors (the norm's own square root is not taken here: sq >= 0 or NaN, so
    // √sq is finite exactly where sq is, the overflow test's question; a rescaled lane's norm is taken below).
    int unsafe = 0, bad = 0;  // bad: a real sample whose norm is not finite
    for (int64_t j = 0; j < BLOCK; ++j) {
      const double first = sdg1[j] * (1.0 + sqa[j]);
      sq[j] = first + t1[j];
      up[j] = upper_norm(std::sqrt(first + hi[j]), one1);
      unsafe |= risky(sq[j], sqa[j], sa[j], gp2[j], da2[j], mask[j]);
      const double clipped = step_down(radius / up[j]);  // in every lane; kept only where up > rad >= 0
      c[j] = (up[j] > radius ? clipped : 1.0) * mask[j];
      bad |= (!(sq[j] <= DBL_MAX) && mask[j] > 0.0) ? 1 : 0;
    }
    // An exactly zero row (zero) is not risky: its squares are exact. It gets what scaling would give it (norm 0,
    // width 0: the same bits), without the per-lane rescaled pass (a third of a KDD Cup 99 round, where many rows
    // are zero) — unless the multipliers alone are out of range, which scaling must see. Then the factors and the
    // overflow flag again, from the norms (√sq where not rescaled).
    if (unsafe) {
      for (int64_t j = 0; j < BLOCK; ++j) {
        norm[j] = std::sqrt(sq[j]);
        if (risky(sq[j], sqa[j], sa[j], gp2[j], da2[j], mask[j])) {
          if (zero[j] && !risky(1.0, sqa[j], sa[j], gp2[j], da2[j], mask[j])) {
            norm[j] = 0.0;
            up[j] = upper_norm(0.0, one_s, 0.0);
            continue;
          }
          double width;
          norm[j] = scaled_norm(in, j, diff, width);
          up[j] = upper_norm(norm[j], one_s, kappa_s * width);
        }
      }
      bad = 0;
      for (int64_t j = 0; j < BLOCK; ++j) {
        const double clipped = step_down(radius / up[j]);
        c[j] = (up[j] > radius ? clipped : 1.0) * mask[j];
        bad |= (!(std::fabs(norm[j]) <= DBL_MAX) && mask[j] > 0.0) ? 1 : 0;
      }
    }
    if (factors != nullptr)
      for (int64_t j = 0; j < BLOCK; ++j) factors[j] = c[j];
    if (accf != nullptr) {
      sums_f32(in, c);
      return bad != 0;
    }
    // clipped sums, per lane: W_2 += c dg_L aᵀ (+ c g_L' daᵀ), b_2 += c dg_L, W_1 += c dg_1 xᵀ, b_1 += c dg_1
    double* aw1 = acc;
    double* ab1 = aw1 + H * F * BLOCK;
    double* aw2 = ab1 + H * BLOCK;
    double* ab2 = aw2 + O * H * BLOCK;
    double cd[BLOCK], cg[BLOCK];
    for (int64_t o = 0; o < O; ++o) {
      const double* dv = dgl + o * BLOCK;
      const double* pv = gpl + o * BLOCK;
      double* b2 = ab2 + o * BLOCK;
      for (int64_t j = 0; j < BLOCK; ++j) { cd[j] = dv[j] * c[j]; b2[j] = b2[j] + cd[j]; }
      if (diff) {
        for (int64_t j = 0; j < BLOCK; ++j) cg[j] = pv[j] * c[j];
        for (int64_t h = 0; h < H; ++h) {
          double* w = aw2 + (o * H + h) * BLOCK;
          const double* ah = av + h * BLOCK;
          const double* dah = dav + h * BLOCK;
          for (int64_t j = 0; j < BLOCK; ++j) w[j] = w[j] + (cd[j] * ah[j] + cg[j] * dah[j]);
        }
      } else {
        for (int64_t h = 0; h < H; ++h) {
          double* w = aw2 + (o * H + h) * BLOCK;
          const double* ah = av + h * BLOCK;
          for (int64_t j = 0; j < BLOCK; ++j) w[j] = w[j] + cd[j] * ah[j];
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const double* dg = dg1 + h * BLOCK;
      double* b1 = ab1 + h * BLOCK;
      for (int64_t j = 0; j < BLOCK; ++j) { cd[j] = dg[j] * c[j]; b1[j] = b1[j] + cd[j]; }
      if (cd1 != nullptr) {  // W_1 is left to the caller's matrix product (many features)
        double* out = cd1 + h * cd1s;
        for (int64_t j = 0; j < BLOCK; ++j) out[j] = cd[j];
        continue;
      }
      for (int64_t f = 0; f < F; ++f) {
        double* w = aw1 + (h * F + f) * BLOCK;
        const double* xf = in.x + f * in.sx;
        for (int64_t j = 0; j < BLOCK; ++j) w[j] = w[j] + cd[j] * xf[j];
      }
    }
    return bad != 0;
  }
};

// n elements from a 64-byte boundary: a row of BLOCK lanes (64 or 128 bytes) never straddles cache lines (a
// std::vector's 16-byte alignment made a process's float32 sums ~25 % slower or not, by where its buffers fell).
template <typename V>
struct Aligned {
  std::vector<V> buf;
  V* ptr;
  size_t n;
  explicit Aligned(size_t count) : buf(count + 64 / sizeof(V), V(0)), n(count) {
    const auto at = reinterpret_cast<uintptr_t>(buf.data());
    ptr = reinterpret_cast<V*>((at + 63) & ~uintptr_t(63));
  }
  V* data() { return ptr; }
  size_t size() const { return n; }
  V& operator[](size_t i) { return ptr[i]; }
};

// Two-valued columns (fused.py's ``two_valued``): ``T`` columns ``cols`` of x whose records take the value ``base``
// (the smaller magnitude) or ``minor`` only. Their W_1 sums are Σ_n u_n x_nj = b_j (S - S_min,j - S_exc,j) + m_j S_min,j
// + E_j, u_n = c dg_1 of sample n as the W_1 sums take it (float64 c dg_1; float32 mode: fl32(c S dg_1)), S = Σ_n u_n,
// S_min,j over the records whose value is m_j, and for a record with another value v (an exception: none in the data
// the layout was taken from, but the kernel takes any record) S_exc,j = Σ u_n and E_j = Σ u_n v. The entries go by
// block of TWO_FLUSH samples of a client (fixed positions), then by slot: block b of client p holds the groups
// blk[p·nb + b] .. blk[p·nb + b + 1] - 1, group g the slot grp[g] (-1 - t for exceptions) and the entries
// start[g] .. start[g + 1] - 1, each a record's offset in the block (``row``) and its value (``val``). A group's sum
// (at most TWO_FLUSH terms, in record order) is a float64 partial, added into the client's total; S in float32 mode
// in float64 lane sums (the b_1 sums are float32 windows). The dense columns ``dcols`` (FD) keep the product path
// (x_rows holds them only).
struct TwoValued {
  int64_t T = 0;
  const int64_t* cols = nullptr;
  const double *base = nullptr, *minor = nullptr;
  const int64_t* blk = nullptr;
  const int32_t* grp = nullptr;
  const int64_t* start = nullptr;
  const int32_t* row = nullptr;
  const double* val = nullptr;
  const int64_t* dcols = nullptr;
  int64_t FD = 0;
};
constexpr int64_t TWO_SUB = 64;     // samples per sub-block of u (fused.py's PRODUCT_BLOCK: float32 mode's rows)
constexpr int64_t TWO_FLUSH = 256;  // samples per block of the two-valued sums (fused.py's TWO_VALUED_BLOCK)

// One group's sums, HP = C·8 doubles at a time (C = 2: two vectors, H <= 16; else C = 1, HP / 8 passes): the rows
// ``row[e]`` of ``ub`` [., HP] added in entry order from 0, then into ``o``; with ``val`` (exceptions) also the rows
// times their values into ``ov``.
template <int C>
inline void group_sums(const double* __restrict ub, int64_t HP, const int32_t* __restrict row, int64_t e0, int64_t e1,
                       const double* __restrict val, double* __restrict o, double* __restrict ov) {
  for (int64_t h0 = 0; h0 < HP; h0 += 8 * C) {
    double acc[8 * C], accv[8 * C];
    for (int i = 0; i < 8 * C; ++i) { acc[i] = 0.0; accv[i] = 0.0; }
    for (int64_t e = e0; e < e1; ++e) {
      const double* ur = ub + row[e] * HP + h0;
      if (val == nullptr) {
        for (int i = 0; i < 8 * C; ++i) acc[i] = acc[i] + ur[i];
      } else {
        const double v = val[e];
        for (int i = 0; i < 8 * C; ++i) { acc[i] = acc[i] + ur[i]; accv[i] = accv[i] + ur[i] * v; }
      }
    }
    for (int i = 0; i < 8 * C; ++i) o[h0 + i] = o[h0 + i] + acc[i];
    if (val != nullptr)
      for (int i = 0; i < 8 * C; ++i) ov[h0 + i] = ov[h0 + i] + accv[i];
  }
}

// The forward pass, when ``par`` is set: per run its parameters [K, d] in T, the activation and loss codes, the
// inputs xt [F, M] and targets y [M] in T; it writes a, φ', g_L (the arrays a, dphi, gl) and ℓ [K, M] block by
// block, each block just before its backward pass reads it from the caches.
template <typename T>
struct Forward {
  const T* par;
  int act, loss;
  const T *xt, *y;
  T* ls;
};

// The two-valued sums of one run for a client (the entries of its blocks ``blk[0] .. blk[nb]``, of ``tv``): u [H]
// rows ``stride`` apart, sub-block q's (TWO_SUB samples) from u + q·bstride (in float32 mode rows of 64 lanes, the
// padding 0); per block of TWO_FLUSH samples its u transposed to ``ub`` [TWO_FLUSH, HP] (float64, H padded to HP: whole
// vectors), then per group its slot's sums in registers (group_sums), added into the totals ``tot`` [3, T, HP] (S_min,
// S_exc, E); with ``lanes`` [H, BLOCK] (float32 mode), S's lane sums, sample n in lane n mod BLOCK, in sample order.
template <typename U>
__attribute__((noinline)) void two_valued_sums(const U* __restrict u, int64_t stride, int64_t bstride, int64_t N,
                                               int64_t H, int64_t HP,
                                               const TwoValued& tv, const int64_t* __restrict blk,
                                               double* __restrict ub, double* __restrict tot,
                                               double* __restrict lanes) {
  const int64_t TH = tv.T * HP, nb = (N + TWO_FLUSH - 1) / TWO_FLUSH;
  const int32_t* __restrict grp = tv.grp;
  const int64_t* __restrict start = tv.start;
  const int32_t* __restrict row = tv.row;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n0 = b * TWO_FLUSH, width = std::min<int64_t>(TWO_FLUSH, N - n0);
    const bool any = blk[b] != blk[b + 1];
    for (int64_t q0 = 0; q0 < width; q0 += TWO_SUB) {
      const U* ublk = u + (n0 + q0) / TWO_SUB * bstride;
      const int64_t w = std::min<int64_t>(TWO_SUB, width - q0);
      if (lanes != nullptr)  // whole blocks of BLOCK lanes (float32 mode: the rows' padding past N is 0)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j0 = 0; j0 < w; j0 += BLOCK)
            for (int64_t j = 0; j < BLOCK; ++j)
              lanes[h * BLOCK + j] = lanes[h * BLOCK + j] + static_cast<double>(ublk[h * stride + j0 + j]);
      if (any)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t r = 0; r < w; ++r) ub[(q0 + r) * HP + h] = static_cast<double>(ublk[h * stride + r]);
    }
    for (int64_t g = blk[b]; g < blk[b + 1]; ++g) {
      const int32_t s = grp[g];
      const int64_t t = s >= 0 ? s : -1 - static_cast<int64_t>(s);
      const double* val = s >= 0 ? nullptr : tv.val;  // exceptions: S_exc and E
      double* o = tot + (s >= 0 ? 0 : TH) + t * HP;
      if (HP == 16)
        group_sums<2>(ub, HP, row, start[g], start[g + 1], val, o, tot + 2 * TH + t * HP);
      else
        group_sums<1>(ub, HP, row, start[g], start[g + 1], val, o, tot + 2 * TH + t * HP);
    }
  }
}

template <typename T>
void fused(int64_t P, int64_t K, int64_t H, int64_t O, int64_t F, int64_t N, const T* a, const T* dphi,
           const T* gl, const T* w2, const T* ap, const T* dphip, const T* glp, const T* w2p,
           const uint8_t* restart, const double* x, const double* sqa, const double* mask, const double* radius,
           double* sums, uint8_t* overflow, void* cd1v, bool blocked, double kappa, double kappa_s,
           double* factors, const double* scale, int64_t flush, int64_t pblock, const float* xrows, int64_t fpad,
           const TwoValued& tv = TwoValued{}, const Forward<T>& fw = Forward<T>{}) {
  const int64_t d = H * F + H + O * H + O, M = P * N;
  // Float32 windows (``scale`` set, T = float: fused.py's accumulate="float32"): run k's terms times scale[k] (a power
  // of two) in float32 lane partials, added into the float64 ones every ``flush`` blocks of a client (windows at fixed
  // block positions: blocks w·flush .. (w + 1)·flush - 1, the tail block in the last). With ``xrows`` (float32 inputs
  // [P, ⌈N / pblock⌉·pblock, fpad], rows of samples, zero-padded; pblock a multiple of BLOCK): W_1's sums are block
  // products instead — a client's c S dg_1 go as float32 into ``cdbuf`` [⌈N / pblock⌉, K, H, pblock] (the lanes past
  // N stay 0), and after its runs, per product block of pblock consecutive samples and per run, the float32 product
  // (block_product) is added into the run's float64 W_1 sums ``wacc`` (divided by S: exact). Float64 mode: cd1 (if
  // set) is float64 [K, H, M] like a, for the caller's product.
  const bool f32 = std::is_same_v<T, float> && scale != nullptr;
  double* cd1 = f32 ? nullptr : static_cast<double*>(cd1v);
  const bool products = f32 && xrows != nullptr;
  const int64_t nprod = products ? (N + pblock - 1) / pblock : 0;
  Aligned<float> cdbuf(nprod * K * H * pblock), prod(products ? H * fpad : 0);
  std::vector<double> wacc(products ? K * H * F : 0);
  float* cd1f = products ? cdbuf.data() : nullptr;
  Aligned<float> accf(f32 ? d * BLOCK : 0), xb(f32 ? Kernel<T>::PENDING * F * BLOCK : 0),
      pcf(f32 ? Kernel<T>::PENDING * H * BLOCK : 0), tcd1f(f32 ? H * BLOCK : 0);
  // Row r of the ``width`` samples from column m of an array of R rows (per run) whose rows are M apart (sample
  // rows), or in the blocked layout (``blocked``): each chunk of a client's samples — its blocks, then its tail —
  // holds its R rows one after another (r · width + j), chunks in the order of their samples; the same R · M
  // elements. Blocked, a block's inputs and parts are a few contiguous cache lines, not R rows M apart (R streams).
  const auto row = [blocked, M](auto* base, int64_t R, int64_t m, int64_t r, int64_t width) {
    return blocked ? base + m * R + r * width : base + r * M + m;
  };
  const int64_t rs = blocked ? BLOCK : M;  // a full block's row stride
  const bool forward = fw.par != nullptr;
  // The forward pass without ``a`` (dphi, gl): this pass is not kept — no difference row of a later round reads it, and
  // this call has none — so each block's a, φ', g_L stay in block-sized scratch rows, in the caches, never written out.
  const bool keep = !forward || a != nullptr;
  Aligned<T> ka(keep ? 0 : H * BLOCK), kd(keep ? 0 : H * BLOCK), kg(keep ? 0 : O * BLOCK);
  Aligned<T> zw(O * BLOCK), hb(H * BLOCK);
  std::vector<T> txt(F * BLOCK, T(0)), ty(BLOCK, T(0)), tls(BLOCK, T(0));
  std::vector<double> tcd1(H * BLOCK), tfac(BLOCK);
  Aligned<double> acc(d * BLOCK), work((3 * H + 2 * O) * BLOCK);
  const int64_t full = N - N % BLOCK, tail = N - full;
  // Two-valued columns (after a client's runs, per run): the totals of S_min, S_exc, E [3, T, HP] (H padded to HP, a
  // multiple of 8: a group's sums are whole vectors), a block's u transposed, S's lanes (float32 mode).
  const bool two = tv.blk != nullptr;
  const int64_t HP = (H + 7) / 8 * 8, TH = two ? tv.T * HP : 0, tnb = (N + TWO_FLUSH - 1) / TWO_FLUSH;
  Aligned<double> ttot(3 * TH), tub(two ? TWO_FLUSH * HP : 0);
  std::vector<double> tsall(two ? H * BLOCK : 0);
  // the last, partial block of a client: copies padded with zeros (mask 0: clip factor 0, never an overflow)
  std::vector<T> ta(H * BLOCK, T(0)), tdphi(H * BLOCK, T(0)), tgl(O * BLOCK, T(0)), tap(H * BLOCK, T(0)),
      tdphip(H * BLOCK, T(0)), tglp(O * BLOCK, T(0));
  std::vector<double> tx(F * BLOCK, 0.0), tsqa(BLOCK, 0.0), tmask(BLOCK, 0.0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t start = p * N;  // client p's samples: columns start .. start + N of every row (rows M apart)
    for (int64_t f = 0; f < F; ++f)
      for (int64_t j = 0; j < tail; ++j) tx[f * BLOCK + j] = row(x, F, start + full, f, tail)[j];
    for (int64_t j = 0; j < tail; ++j) { tsqa[j] = sqa[start + full + j]; tmask[j] = mask[start + full + j]; }
    if (forward) {
      for (int64_t f = 0; f < F; ++f)
        for (int64_t j = 0; j < tail; ++j) txt[f * BLOCK + j] = row(fw.xt, F, start + full, f, tail)[j];
      for (int64_t j = 0; j < tail; ++j) ty[j] = fw.y[start + full + j];
    }
    for (int64_t k = 0; k < K; ++k) {
      const bool diff = ap != nullptr && !(restart != nullptr && restart[k]);
      Kernel<T> ker{H, O, F, w2 + k * O * H, diff ? w2p + k * O * H : nullptr, radius[k], acc.data(), work.data(),
                    work.data() + H * BLOCK, work.data() + 2 * H * BLOCK, work.data() + 3 * H * BLOCK,
                    work.data() + 3 * H * BLOCK + O * BLOCK};
      std::memset(acc.data(), 0, sizeof(double) * acc.size());
      if (f32) {
        std::memset(accf.data(), 0, sizeof(float) * accf.size());
        ker.accf = accf.data();
        ker.xb = xb.data();
        ker.pcf = pcf.data();
        ker.scale = scale[k];
      }
      // float32 windows: the window's partials into the float64 lane sums (divided by S: exact), W_1's only if the
      // kernel takes them
      const int64_t lo = cd1f != nullptr ? H * F * BLOCK : 0;
      int64_t window = 0;
      const auto next_block = [&](bool last) {
        if (!f32 || (++window < flush && !last)) return;
        ker.drain();
        const double inv = 1.0 / scale[k];
        double* a64 = acc.data();
        float* a32 = accf.data();
        for (int64_t i = lo; i < d * BLOCK; ++i) {
          a64[i] = a64[i] + static_cast<double>(a32[i]) * inv;
          a32[i] = 0.0f;
        }
        window = 0;
      };
      // run k's float32 c S dg_1 for the block of samples n .. n + BLOCK - 1 of client p, and its rows' stride
      const auto cd1_at = [&](int64_t n, int64_t& stride) -> float* {
        stride = pblock;
        return cd1f + ((n / pblock) * K + k) * H * pblock + n % pblock;
      };
      ker.kappa = kappa;
      ker.kappa_s = kappa_s;
      ker.one = step_up(1.0 + kappa);
      ker.one_s = step_up(1.0 + kappa_s);
      double* fk = factors == nullptr ? nullptr : factors + k * M + start;  // [K, M]
      // run k's arrays (H · M or O · M elements each, in either layout)
      const T* ak = keep ? a + k * H * M : nullptr;
      const T* dk = keep ? dphi + k * H * M : nullptr;
      const T* gk = keep ? gl + k * O * M : nullptr;
      const T* apk = diff ? ap + k * H * M : nullptr;
      const T* dpk = diff ? dphip + k * H * M : nullptr;
      const T* gpk = diff ? glp + k * O * M : nullptr;
      bool bad = false;
      double* cdk = cd1 == nullptr ? nullptr : cd1 + k * H * M + start;  // [K, H, M] like a
      ker.cd1s = M;
      for (int64_t n = 0; n < full; n += BLOCK) {
        const int64_t m = start + n;
        const T* ab = keep ? row(ak, H, m, 0, BLOCK) : ka.data();
        const T* db = keep ? row(dk, H, m, 0, BLOCK) : kd.data();
        const T* gb = keep ? row(gk, O, m, 0, BLOCK) : kg.data();
        const int64_t s = keep ? rs : BLOCK;
        Block<T> in{ab, db, gb, diff ? row(apk, H, m, 0, BLOCK) : nullptr, diff ? row(dpk, H, m, 0, BLOCK) : nullptr,
                    diff ? row(gpk, O, m, 0, BLOCK) : nullptr, row(x, F, m, 0, BLOCK), sqa + m, mask + m, s, rs};
        ker.cd1 = cdk == nullptr ? nullptr : cdk + n;
        if (cd1f != nullptr) ker.cd1f = cd1_at(n, ker.cd1s);
        ker.factors = fk == nullptr ? nullptr : fk + n;
        if (forward)
          forward_block(fw.par + k * d, H, O, F, fw.act, fw.loss, row(fw.xt, F, m, 0, BLOCK), rs, fw.y + m,
                        const_cast<T*>(ab), const_cast<T*>(db), const_cast<T*>(gb), fw.ls + k * M + start + n, s,
                        zw.data(), hb.data());
        bad |= ker.block(in);
        next_block(n + BLOCK == full && tail == 0);
      }
      if (tail) {
        if (forward) {  // into the padded copies, then out; padding lanes back to 0 (no inf · 0 in a sum)
          forward_block(fw.par + k * d, H, O, F, fw.act, fw.loss, txt.data(), BLOCK, ty.data(), ta.data(),
                        tdphi.data(), tgl.data(), tls.data(), BLOCK, zw.data(), hb.data());
          T* lk = fw.ls + k * M + start + full;
          for (int64_t j = 0; j < tail; ++j) lk[j] = tls[j];
          for (int64_t h = 0; h < H; ++h) {
            if (keep) {
              T* ao = const_cast<T*>(row(ak, H, start + full, h, tail));
              T* dout = const_cast<T*>(row(dk, H, start + full, h, tail));
              for (int64_t j = 0; j < tail; ++j) { ao[j] = ta[h * BLOCK + j]; dout[j] = tdphi[h * BLOCK + j]; }
            }
            for (int64_t j = tail; j < BLOCK; ++j) { ta[h * BLOCK + j] = T(0); tdphi[h * BLOCK + j] = T(0); }
          }
          for (int64_t o = 0; o < O; ++o) {
            if (keep) {
              T* go = const_cast<T*>(row(gk, O, start + full, o, tail));
              for (int64_t j = 0; j < tail; ++j) go[j] = tgl[o * BLOCK + j];
            }
            for (int64_t j = tail; j < BLOCK; ++j) tgl[o * BLOCK + j] = T(0);
          }
        }
        const int64_t mt = start + full;
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < tail; ++j) {
            if (!forward) {
              ta[h * BLOCK + j] = row(ak, H, mt, h, tail)[j];
              tdphi[h * BLOCK + j] = row(dk, H, mt, h, tail)[j];
            }
            if (diff) {
              tap[h * BLOCK + j] = row(apk, H, mt, h, tail)[j];
              tdphip[h * BLOCK + j] = row(dpk, H, mt, h, tail)[j];
            }
          }
        for (int64_t o = 0; o < O; ++o)
          for (int64_t j = 0; j < tail; ++j) {
            if (!forward) tgl[o * BLOCK + j] = row(gk, O, mt, o, tail)[j];
            if (diff) tglp[o * BLOCK + j] = row(gpk, O, mt, o, tail)[j];
          }
        Block<T> in{ta.data(), tdphi.data(), tgl.data(), diff ? tap.data() : nullptr, diff ? tdphip.data() : nullptr,
                    diff ? tglp.data() : nullptr, tx.data(), tsqa.data(), tmask.data(), BLOCK, BLOCK};
        ker.cd1 = cdk == nullptr ? nullptr : tcd1.data();
        ker.cd1s = BLOCK;
        if (cd1f != nullptr) ker.cd1f = tcd1f.data();
        ker.factors = fk == nullptr ? nullptr : tfac.data();
        bad |= ker.block(in);
        next_block(true);
        if (fk != nullptr)
          for (int64_t j = 0; j < tail; ++j) fk[full + j] = tfac[j];
        if (cdk != nullptr)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t j = 0; j < tail; ++j) cdk[h * M + full + j] = tcd1[h * BLOCK + j];
        if (cd1f != nullptr) {
          int64_t st;
          float* out = cd1_at(full, st);
          for (int64_t h = 0; h < H; ++h)
            for (int64_t j = 0; j < tail; ++j) out[h * st + j] = tcd1f[h * BLOCK + j];
        }
      }
      double* out = sums + (p * K + k) * d;
      for (int64_t i = 0; i < d; ++i) {
        const double* lane = acc.data() + i * BLOCK;
        double total = lane[0];
        for (int64_t j = 1; j < BLOCK; ++j) total = total + lane[j];
        out[i] = total;
      }
      overflow[p * K + k] = bad ? 1 : 0;
    }
    if (products) {  // W_1's sums of client p: per product block, each run's float32 product, into float64
      std::fill(wacc.begin(), wacc.end(), 0.0);
      for (int64_t blk = 0; blk < nprod; ++blk) {
        const float* xblk = xrows + (p * nprod + blk) * pblock * fpad;
        for (int64_t k = 0; k < K; ++k) {
          block_product(cdbuf.data() + (blk * K + k) * H * pblock, xblk, H, pblock, fpad, prod.data());
          const double inv = 1.0 / scale[k];
          double* w = wacc.data() + k * H * F;
          if (two) {  // the dense columns only
            for (int64_t h = 0; h < H; ++h)
              for (int64_t f = 0; f < tv.FD; ++f) {
                double& wf = w[h * F + tv.dcols[f]];
                wf = wf + static_cast<double>(prod[h * fpad + f]) * inv;
              }
            continue;
          }
          for (int64_t h = 0; h < H; ++h)
            for (int64_t f = 0; f < F; ++f) w[h * F + f] = w[h * F + f] + static_cast<double>(prod[h * fpad + f]) * inv;
        }
      }
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(sums + (p * K + k) * d, wacc.data() + k * H * F, sizeof(double) * H * F);
    }
    if (two)  // W_1's two-valued sums, per run: b (S - S_min - S_exc) + m S_min + E, in float64 (divided by S: exact)
      for (int64_t k = 0; k < K; ++k) {
        std::memset(ttot.data(), 0, sizeof(double) * ttot.size());
        std::fill(tsall.begin(), tsall.end(), 0.0);
        const int64_t* blk = tv.blk + p * tnb;
        if (f32)
          two_valued_sums(cdbuf.data() + k * H * pblock, pblock, K * H * pblock, N, H, HP, tv, blk, tub.data(),
                          ttot.data(), tsall.data());
        else
          two_valued_sums(cd1 + k * H * M + p * N, M, TWO_SUB, N, H, HP, tv, blk, tub.data(), ttot.data(),
                          static_cast<double*>(nullptr));
        double* out = sums + (p * K + k) * d;
        const double inv = f32 ? 1.0 / scale[k] : 1.0;
        const double *tmin = ttot.data(), *texs = tmin + TH, *tes = texs + TH;
        for (int64_t h = 0; h < H; ++h) {
          double all = out[H * F + h];  // float64 mode: S is the b_1 sum
          if (f32) {
            const double* lane = tsall.data() + h * BLOCK;
            all = lane[0];
            for (int64_t j = 1; j < BLOCK; ++j) all = all + lane[j];
          }
          for (int64_t t = 0; t < tv.T; ++t) {
            const int64_t i = t * HP + h;
            const double rest = (all - tmin[i]) - texs[i];
            const double v = (tv.base[t] * rest + tv.minor[t] * tmin[i]) + tes[i];
            out[h * F + tv.cols[t]] = f32 ? v * inv : v;
          }
        }
      }
  }
}

}  // namespace

extern "C" {

int64_t diff2_fused_block() { return BLOCK; }

#define DIFF2_FUSED_ENTRY(NAME, T)                                                                              \
  void NAME(int64_t P, int64_t K, int64_t H, int64_t O, int64_t F, int64_t N, const T* a, const T* dphi,       \
            const T* gl,                                                                                          \
            const T* w2, const T* ap, const T* dphip, const T* glp, const T* w2p, const uint8_t* restart,         \
            const double* x, const double* sqa, const double* mask, const double* radius, double* sums,           \
            uint8_t* overflow, void* cd1, int64_t blocked, double kappa, double kappa_s, double* factors,         \
            const double* scale, int64_t flush, int64_t pblock, const float* xrows, int64_t fpad, int64_t tT,        \
            const int64_t* tcols, const double* tbase, const double* tminor, const int64_t* tblk,                \
            const int32_t* tgrp, const int64_t* tstart, const int32_t* trow, const double* tval,                 \
            const int64_t* tdcols, int64_t tFD) {                                                                \
    const TwoValued tv{tT, tcols, tbase, tminor, tblk, tgrp, tstart, trow, tval, tdcols, tFD};                 \
    fused<T>(P, K, H, O, F, N, a, dphi, gl, w2, ap, dphip, glp, w2p, restart, x, sqa, mask, radius, sums, overflow, \
             cd1, blocked != 0, kappa, kappa_s, factors, scale, flush, pblock, xrows, fpad, tv);                 \
  }

DIFF2_FUSED_ENTRY(diff2_fused_f32, float)
DIFF2_FUSED_ENTRY(diff2_fused_f64, double)

// The same with the forward pass in the kernel (``Forward``): a, dphi, gl and ls are written, not read; a, dphi and gl
// null (with ap null): the pass is not kept (only the sums, overflow flags and ls are written).
#define DIFF2_FORWARD_ENTRY(NAME, T)                                                                            \
  void NAME(int64_t P, int64_t K, int64_t H, int64_t O, int64_t F, int64_t N, const T* par, int64_t act,       \
            int64_t loss, const T* xt, const T* y, T* a, T* dphi, T* gl, T* ls, const T* w2, const T* ap,         \
            const T* dphip, const T* glp, const T* w2p, const uint8_t* restart, const double* x,                 \
            const double* sqa, const double* mask, const double* radius, double* sums, uint8_t* overflow,         \
            void* cd1, int64_t blocked, double kappa, double kappa_s, double* factors, const double* scale,        \
            int64_t flush, int64_t pblock, const float* xrows, int64_t fpad, int64_t tT, const int64_t* tcols,    \
            const double* tbase, const double* tminor, const int64_t* tblk, const int32_t* tgrp,                 \
            const int64_t* tstart, const int32_t* trow, const double* tval, const int64_t* tdcols,               \
            int64_t tFD) {                                                                                         \
    const Forward<T> fw{par, static_cast<int>(act), static_cast<int>(loss), xt, y, ls};                        \
    const TwoValued tv{tT, tcols, tbase, tminor, tblk, tgrp, tstart, trow, tval, tdcols, tFD};                 \
    fused<T>(P, K, H, O, F, N, a, dphi, gl, w2, ap, dphip, glp, w2p, restart, x, sqa, mask, radius, sums,      \
             overflow, cd1, blocked != 0, kappa, kappa_s, factors, scale, flush, pblock, xrows, fpad, tv, fw);   \
  }

DIFF2_FORWARD_ENTRY(diff2_forward_f32, float)
DIFF2_FORWARD_ENTRY(diff2_forward_f64, double)

// φ(h) and φ'(h) of n values (the kernel's activations, for tests).
#define DIFF2_ACTIVATION_ENTRY(NAME, T)                                                                         \
  void NAME(int64_t act, int64_t n, const T* h, T* a, T* d) {                                                  \
    T hb[BLOCK], ab[BLOCK], db[BLOCK];                                                                           \
    for (int64_t i = 0; i < n; i += BLOCK) {                                                                     \
      const int64_t m = std::min<int64_t>(BLOCK, n - i);                                                         \
      for (int64_t j = 0; j < BLOCK; ++j) hb[j] = j < m ? h[i + j] : T(0);                                      \
      activate_n<T>(static_cast<int>(act), hb, ab, db, BLOCK);                                                  \
      for (int64_t j = 0; j < m; ++j) { a[i + j] = ab[j]; d[i + j] = db[j]; }                                    \
    }                                                                                                            \
  }

DIFF2_ACTIVATION_ENTRY(diff2_activation_f32, float)
DIFF2_ACTIVATION_ENTRY(diff2_activation_f64, double)

}  // extern "C"
