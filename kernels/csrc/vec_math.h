// Scalar helpers shared by the CPU kernels, written so that loops over them vectorize.
#pragma once

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (uint16_t)(u >> 16);
}

// exp(x) in plain arithmetic so the loop vectorizes (libm's expf does not):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n from the
// exponent bits. Relative error under 2e-7 over the clamped range.
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float n = (x * 1.44269504f + shifter) - shifter;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln2 split hi + lo
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
