// Rows of a packed GGUF weight dequantized as gguf does (the token embedding of a GGUF file kept packed; layers/
// packed_embedding.py): plain C++, one row per id, parallel over ids.
#include "gguf_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <vector>

#include "gguf_tiles.h"

using namespace tokenfab_gguf;

// Row j of one K-quant tile (KB tile-blocks at b) dequantized into r [KB * 256], as gguf's dequantize computes it:
// float32 (d sc) q - dmin m (Q4_K, Q5_K; (d sc) q is exact, so one rounding) or (d scale) (q - 32) (Q6_K).
static void kq_embedding_row(int qt, const uint8_t* b0, int64_t KB, int64_t j, float* r) {
  const int64_t TB = tile_block_bytes(qt), lo_off = kq_lo_off(qt), hi_off = kq_hi_off(qt);
  auto word = [](const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return static_cast<int>(v); };
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* b = b0 + kb * TB;
    c10::Half dh;
    std::memcpy(&dh, b + 2 * j, 2);
    const float d = static_cast<float>(dh);
    float dmin = 0.f;
    if (qt != kQ6_K) {
      std::memcpy(&dh, b + 32 + 2 * j, 2);
      dmin = static_cast<float>(dh);
    }
    for (int sub = 0; sub < 8; ++sub) {
      float ds = 0.f, dm = 0.f;
      if (qt != kQ6_K) {
        const auto sb = [&](int i) { return static_cast<int>(b[64 + 16 * i + j]); };
        const int sc = sub < 4 ? sb(sub) & 63 : (sb(sub + 4) & 15) | ((sb(sub - 4) >> 6) << 4);
        const int mn = sub < 4 ? sb(sub + 4) & 63 : (sb(sub + 4) >> 4) | ((sb(sub) >> 6) << 4);
        ds = d * static_cast<float>(sc);
        dm = dmin * static_cast<float>(mn);
      }
      for (int kk = 0; kk < 32; ++kk) {
        const int pair = kk / 2, e = kk % 2, L = pair / 4, s = pair % 4;
        int q = (word(b + lo_off + 256 * sub + 64 * L + 2 * (2 * j + e)) >> (4 * s)) & 15;
        float v;
        if (qt == kQ6_K) {
          q |= ((word(b + hi_off + 128 * sub + 64 * (pair / 8) + 2 * (2 * j + e)) >> (2 * (pair % 8))) & 3) << 4;
          const float dsc = d * static_cast<float>(static_cast<int8_t>(b[32 + 16 * (2 * sub + kk / 16) + j]));
          v = dsc * static_cast<float>(q - 32);
        } else {
          if (qt == kQ5_K) q |= ((word(b + hi_off + 64 * sub + 2 * (2 * j + e)) >> pair) & 1) << 4;
          v = ds * static_cast<float>(q) - dm;  // ds q is exact: fused or not, one rounding
        }
        r[kb * 256 + 32 * sub + kk] = v;
      }
    }
  }
}

at::Tensor gguf_embedding(const at::Tensor& w, int64_t qtype, int64_t n, const at::Tensor& ids,
                          bool bf16_out) {
  const int64_t TB = tile_block_bytes(qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == TB &&
              w.size(0) == (n + TN - 1) / TN && n > 0,
              "gguf_embedding: weight ", w.sizes(), " does not hold ", n, " rows of ggml type ", qtype);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "gguf_embedding: int64 ids expected, got ", ids.scalar_type());
  const auto dtype = bf16_out ? at::kBFloat16 : at::kFloat;
  const int64_t KB = w.size(1), K = KB * block_k(static_cast<int>(qtype));
  const auto idc = ids.contiguous();
  const int64_t T = idc.numel();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  auto y = at::empty(shape, ids.options().dtype(dtype));
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "gguf_embedding: id ", ip[i], " is outside the ", n, " rows");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t qoff = (qtype == kQ4_1 ? 4 : 2) * TN;
  at::parallel_for(0, T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(K);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = ip[i] / TN, j = ip[i] % TN;
      if (is_kquant(static_cast<int>(qtype))) {
        kq_embedding_row(static_cast<int>(qtype), wp + t * KB * TB, KB, j, row.data());
      }
      for (int64_t kb = 0; !is_kquant(static_cast<int>(qtype)) && kb < KB; ++kb) {
        const uint8_t* b = wp + (t * KB + kb) * TB;
        c10::Half dh, mh;
        std::memcpy(&dh, b + 2 * j, 2);
        const float d = static_cast<float>(dh);
        float mn = 0.f;
        if (qtype == kQ4_1) {
          std::memcpy(&mh, b + 2 * TN + 2 * j, 2);
          mn = static_cast<float>(mh);
        }
        float* r = row.data() + kb * QK;
        for (int64_t k = 0; k < QK; ++k) {
          const int64_t pair = k / 2, e = k % 2;
          if (qtype == kQ8_0) {
            r[k] = d * static_cast<float>(static_cast<int8_t>(b[qoff + pair * 32 + 2 * j + e]));
          } else {  // word 2j + e of group pair / 4 holds the quant in nibble pair % 4
            uint16_t word;
            std::memcpy(&word, b + qoff + 64 * (pair / 4) + 2 * (2 * j + e), 2);
            const int q = (word >> (4 * (pair % 4))) & 15;
            // q d is exact in float32 (a 4-bit integer times an fp16), so q d + m rounds once, as gguf computes it
            r[k] = qtype == kQ4_1 ? static_cast<float>(q) * d + mn : d * static_cast<float>(q - 8);
          }
        }
      }
      if (dtype == at::kFloat) {
        std::memcpy(y.data_ptr<float>() + i * K, row.data(), K * sizeof(float));
      } else {
        auto* yr = y.data_ptr<at::BFloat16>() + i * K;
        for (int64_t k = 0; k < K; ++k) yr[k] = at::BFloat16(row[k]);  // round to nearest even, as Tensor.to
      }
    }
  });
  return y;
}
