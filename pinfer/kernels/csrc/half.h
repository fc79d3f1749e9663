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
#endif

#endif
