/* What TDPBF16PS adds to an fp32 accumulator, checked on this CPU (tests/unit/kernels/test_cpu_amx.py;
 * docs/performance.md, "AMX tiles at one row"). For random bf16 operands at several exponent
 * ranges (and an accumulator loaded first), each of 16 x 16 outputs of two tile instructions
 * (K = 64) is compared with:
 *   model: per instruction c = c + (E + O), E = (((0 + p0) + p2) + ... + p30) and O likewise over
 *          the odd products, every add fp32 round-to-nearest-even, FTZ and DAZ;
 *   emul:  the same with vdpbf16ps: two chains per output, x with the odd (even) bf16 of each pair
 *          zeroed, then two vaddps under MXCSR FTZ | DAZ;
 *   seq:   vdpbf16ps's own order (one chain over all pairs): expected to differ (the check can fail).
 * Prints "cases N model M emul E seq S" (mismatch counts); exit 2 when AMX is refused. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
enum { K = 64, KB = K / 32 };
static uint32_t seed = 12345;
static uint32_t rnd(void) { seed ^= seed << 13; seed ^= seed >> 17; seed ^= seed << 5; return seed; }
static uint16_t to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
static float from_bf16(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t draw(int spread) {
    if (rnd() % 4 == 0) return 0;
    float f = ((int)(rnd() % 20001) - 10000) / 1000.0f;
    return to_bf16(ldexpf(f, (int)(rnd() % (2 * spread + 1)) - spread));
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int i = 0; i < 3; i++) { c.rows[i] = 16; c.colsb[i] = 64; }
    _tile_loadconfig(&c);
    static uint16_t W[16][K], X[16][K];
    static uint32_t B[KB][16][16];
    float C[16][16], C0[16][16];
    const int spreads[] = {0, 8, 30, 60};
    long cases = 0, bad_model = 0, bad_emul = 0, bad_seq = 0;
    const unsigned csr = _mm_getcsr();
    for (int round = 0; round < 200; round++) {
        const int spread = spreads[round % 4];
        for (int i = 0; i < 16; i++)
            for (int k = 0; k < K; k++) { W[i][k] = draw(spread); X[i][k] = draw(spread); }
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) C0[i][j] = round % 2 ? from_bf16(draw(spread)) * from_bf16(draw(spread)) : 0.0f;
        for (int kb = 0; kb < KB; kb++)   /* B: row r = pair r of every token (VNNI) */
            for (int r = 0; r < 16; r++)
                for (int t = 0; t < 16; t++) memcpy(&B[kb][r][t], &X[t][32 * kb + 2 * r], 4);
        _tile_loadd(0, C0, 64);
        for (int kb = 0; kb < KB; kb++) {
            _tile_loadd(1, &W[0][32 * kb], 2 * K);
            _tile_loadd(2, B[kb], 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, C, 64);
        for (int ch = 0; ch < 16; ch++)
            for (int t = 0; t < 16; t++) {
                float model = C0[ch][t], emul, seq;
                _mm_setcsr(csr | 0x8040);
                for (int kb = 0; kb < KB; kb++) {
                    float e = 0.0f, o = 0.0f;
                    for (int k = 32 * kb; k < 32 * kb + 32; k += 2) {
                        e = e + from_bf16(W[ch][k]) * from_bf16(X[t][k]);
                        o = o + from_bf16(W[ch][k + 1]) * from_bf16(X[t][k + 1]);
                    }
                    model = model + (e + o);
                }
                __m512 acc = _mm512_set1_ps(C0[ch][t]), sq = acc;
                for (int kb = 0; kb < KB; kb++) {
                    __m512 e = _mm512_setzero_ps(), o = e;
                    for (int r = 0; r < 16; r++) {
                        uint32_t w, x;
                        memcpy(&w, &W[ch][32 * kb + 2 * r], 4);
                        memcpy(&x, &X[t][32 * kb + 2 * r], 4);
                        const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)w);
                        e = _mm512_dpbf16_ps(e, wv, (__m512bh)_mm512_set1_epi32((int)(x & 0xFFFFu)));
                        o = _mm512_dpbf16_ps(o, wv, (__m512bh)_mm512_set1_epi32((int)(x & 0xFFFF0000u)));
                        sq = _mm512_dpbf16_ps(sq, wv, (__m512bh)_mm512_set1_epi32((int)x));
                    }
                    acc = _mm512_add_ps(acc, _mm512_add_ps(e, o));
                }
                emul = _mm512_cvtss_f32(acc);
                seq = _mm512_cvtss_f32(sq);
                _mm_setcsr(csr);
                cases++;
                bad_model += memcmp(&model, &C[ch][t], 4) != 0;
                bad_emul += memcmp(&emul, &C[ch][t], 4) != 0;
                bad_seq += memcmp(&seq, &C[ch][t], 4) != 0;
            }
    }
    _tile_release();
    printf("cases %ld model %ld emul %ld seq %ld\n", cases, bad_model, bad_emul, bad_seq);
    return 0;
}
