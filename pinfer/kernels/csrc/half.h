/* Half-precision helpers shared by pinfer's kernels: half_t and HALF(x) -> float. With GCC 12+ on
 * x86-64, half_t is _Float16 and converts with F16C inside AVX2/AVX-512 code; elsewhere it is the
 * raw bits, converted in software. */
#ifndef PINFER_HALF_H
#define PINFER_HALF_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 12
typedef _Float16 half_t;
#define HALF(x) ((float)(x))
static inline half_t to_half(float f) { return (half_t)f; }   /* rounds to nearest, ties to even */
#else
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
typedef uint16_t half_t;
#define HALF(x) f16_to_f32(x)
/* f32 -> f16 bits, rounded to nearest, ties to even (as F16C, NumPy and ONNX Runtime round). */
static inline half_t to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (half_t)(sign | 0x7c00 | (man ? 0x200 : 0));   /* inf, NaN */
    if (exp >= 31) return (half_t)(sign | 0x7c00);                                          /* overflow */
    if (exp <= 0) {                                                                          /* subnormal */
        if (exp < -10) return (half_t)sign;
        man |= 0x800000;
        const int shift = 14 - exp;
        uint32_t h = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (half_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;                /* may carry into the exponent */
    return (half_t)(sign | h);
}
#endif

#endif
