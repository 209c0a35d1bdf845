// Host check of the sm_90a verify-attention kernel's shared-memory layout and wgmma descriptors
// (templates/include/dflashgen/verify_attention_wgmma_layout.cuh) against CuTe's canonical GMMA
// layouts: every element's physical position, every k-step's start, the descriptor fields that
// make_gmma_desc writes. Built and run by tests/test_attention_kernel.py (g++, CuTe headers).
#include <cstdio>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "dflashgen/verify_attention_wgmma_layout.cuh"

using namespace cute;
namespace wa = dflashgen::wgattn;

static int bad = 0;
#define CHECK(cond, ...)          \
  if (!(cond)) {                  \
    if (++bad < 20) {             \
      std::printf(__VA_ARGS__);   \
      std::printf("\n");          \
    }                             \
  }

// CuTe applies a GMMA atom's swizzle to the byte address (swizzle_ptr): byte = Sw<3,4,3>(2 x offset).
template <class L>
int phys_bytes(L const& l, int a, int b) {
  const int byte = 2 * l.layout_b()(a, b);
  return byte ^ (((byte >> 7) & 7) << 4);
}

// Rows x 256 K-major (Q, K): element (r, k) at sw128_off(r, k / 8) + 2 (k % 8); k-step starts.
template <int R>
void kmajor() {
  auto l = tile_to_shape(GMMA::Layout_K_SW128_Atom<half_t>{}, Shape<Int<R>, _256>{});
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 256; ++k)
      CHECK(phys_bytes(l, r, k) == wa::sw128_off<R>(r, k / 8) + 2 * (k % 8), "K-major R=%d (%d, %d)", R, r, k);
  for (int ks = 0; ks < 16; ++ks)
    CHECK(2 * l.layout_b()(0, 16 * ks) == wa::kmajor_kstep<R>(ks), "K-major R=%d k-step %d", R, ks);
}

template <int R>
void kmajor_desc() {
  auto l = tile_to_shape(GMMA::Layout_K_SW128_Atom<half_t>{}, Shape<Int<R>, _256>{});
  alignas(1024) static half_t buf[64 * 256];
  auto t = local_tile(make_tensor(make_smem_ptr(buf), l), Shape<Int<R>, _16>{}, make_coord(0, 0));
  GmmaDescriptor d = GMMA::make_gmma_desc<GMMA::Major::K>(t);
  CHECK(d.bitfield.layout_type_ == 1 && d.bitfield.leading_byte_offset_ == wa::KMAJOR_LBO / 16 &&
            d.bitfield.stride_byte_offset_ == wa::KMAJOR_SBO / 16 && d.bitfield.base_offset_ == 0,
        "K-major R=%d descriptor: layout %d lbo %d sbo %d", R, d.bitfield.layout_type_,
        d.bitfield.leading_byte_offset_, d.bitfield.stride_byte_offset_);
}

// V: (N = 256 columns of D, K = T tokens), MN-major, stored as T token rows: (n, k) at
// sw128_off<T>(k, n / 8) + 2 (n % 8); CuTe's atoms tiled along K first, then N.
template <int T>
void mnmajor() {
  auto l = tile_to_shape(GMMA::Layout_MN_SW128_Atom<half_t>{}, Shape<_256, Int<T>>{}, Step<_2, _1>{});
  for (int n = 0; n < 256; ++n)
    for (int k = 0; k < T; ++k)
      CHECK(phys_bytes(l, n, k) == wa::sw128_off<T>(k, n / 8) + 2 * (n % 8), "MN-major T=%d (%d, %d)", T, n, k);
  for (int ks = 0; ks < T / 16; ++ks)
    CHECK(2 * l.layout_b()(0, 16 * ks) == wa::mnmajor_kstep(ks), "MN-major T=%d k-step %d", T, ks);
  alignas(1024) static half_t buf[64 * 256];
  auto t = local_tile(make_tensor(make_smem_ptr(buf), l), Shape<_256, _16>{}, make_coord(0, 0));
  GmmaDescriptor d = GMMA::make_gmma_desc<GMMA::Major::MN>(t);
  CHECK(d.bitfield.layout_type_ == 1 && d.bitfield.leading_byte_offset_ == wa::mnmajor_lbo<T>() / 16 &&
            d.bitfield.stride_byte_offset_ == wa::MNMAJOR_SBO / 16 && d.bitfield.base_offset_ == 0,
        "MN-major T=%d descriptor: layout %d lbo %d sbo %d", T, d.bitfield.layout_type_,
        d.bitfield.leading_byte_offset_, d.bitfield.stride_byte_offset_);
}

// TMA boxes (tma: 1): a page of PAGE = 16 tokens x 64 columns written with SWIZZLE_128B (the pattern
// on the shared address: chunk bits [4, 7) ^= address bits [7, 10)) from tma_box_off lands every
// 16-byte chunk where the cp.async copies put it (sw128_off), so the descriptors read the same tile.
template <int T>
void tma_boxes() {
  for (int tok0 = 0; tok0 < T; tok0 += 16)
    for (int a = 0; a < 4; ++a) {
      const int start = wa::tma_box_off<T>(tok0, a);
      CHECK(start % 1024 == 0, "TMA T=%d box (%d, %d) start %d not 1024-byte aligned", T, tok0, a, start);
      for (int i = 0; i < 16; ++i)
        for (int c = 0; c < 8; ++c) {
          const int lin = start + 128 * i + 16 * c;  // the box's row-major byte, before the swizzle
          const int addr = lin ^ (((lin >> 7) & 7) << 4);
          CHECK(addr == wa::sw128_off<T>(tok0 + i, 8 * a + c) && addr == start + 128 * i + 16 * (c ^ (i & 7)),
                "TMA T=%d token %d chunk %d: %d vs %d", T, tok0 + i, 8 * a + c, addr, wa::sw128_off<T>(tok0 + i, 8 * a + c));
        }
    }
}

int main() {
  tma_boxes<16>();
  tma_boxes<32>();
  tma_boxes<64>();
  kmajor<64>();
  kmajor<32>();
  kmajor<16>();
  kmajor_desc<64>();
  kmajor_desc<32>();
  kmajor_desc<16>();
  mnmajor<16>();
  mnmajor<32>();
  mnmajor<64>();
  std::printf("%s: %d mismatches\n", bad ? "FAIL" : "OK", bad);
  return bad ? 1 : 0;
}
