// Helpers of the sparse MLA decode (mla_sparse_*, see the top of mla_decode.cu): sequence b
// attends to the keys listed in row b of an index array (token positions, -1 for padding)
// rather than to its first tokens; the splits and tiles then run over list entries, and entry
// i's cache row is found through the sequence's block table (pages of 64 rows).
//
// Finding a tile's rows takes two dependent global loads (the list entries, then their
// block-table entries). Done when the tile's copies are issued, they stalled every warp once
// per tile with nothing to overlap. So warp 0 fetches them ahead into a ring of per-tile slots
// in shared memory, by cp.async in the groups of earlier tiles: with tile j's copies go the
// block-table entries of tile j + LAG and the list entries of tile j + 2·LAG, where LAG is how
// many tiles back a kernel's groups are complete (and behind a barrier) when it issues a tile.
// Issuing tile j then reads its rows from the ring. A slot is [positions TILE][pages TILE]
// ints, at the tile's number modulo SPARSE_RING: 2·LAG + 2 slots are live at most (ks3 issues
// its first two tiles with no barrier between).
#pragma once

#define SPARSE_RING 8
#define SPARSE_RING_BYTES(TILE) (SPARSE_RING * 2 * (TILE) * 4)

// Entry i of a list of n entries, or -1 past n.
__device__ __forceinline__ int sparse_pos(const int* list, int i, int n) { return i < n ? list[i] : -1; }

// Bit j set where entry i + j (j < count) of the list is a key, not padding or past n: the
// scores of the other entries are masked to -inf (their zeroed rows alone would score 0).
__device__ __forceinline__ unsigned sparse_keys(const int* list, int i, int n, int count) {
    unsigned bits = 0;
    for (int j = 0; j < count; j++)
        if (i + j < n && list[i + j] >= 0) bits |= 1u << j;
    return bits;
}

// The ring slot of the tile of entries t0.. (tiles lie TILE entries apart).
template <int TILE> __device__ __forceinline__ int* sparse_slot(int* ring, int t0) {
    return ring + ((unsigned)t0 / TILE % SPARSE_RING) * (2 * TILE);
}

// Warp 0, before the first tile: the positions of the first 2·LAG tiles and the pages of the
// first LAG, by plain loads (the one stall of the block). A barrier must follow.
template <int TILE, int LAG>
__device__ __forceinline__ void sparse_ring_start(int* ring, const int* list, const int* bt, int t_begin, int t_end,
                                                  int lane) {
    if (lane >= TILE) return;
#pragma unroll
    for (int j = 0; j < 2 * LAG; j++) {
        int* slot = sparse_slot<TILE>(ring, t_begin + j * TILE);
        const int pos = sparse_pos(list, t_begin + j * TILE + lane, t_end);
        slot[lane] = pos;
        if (j < LAG && pos >= 0) slot[TILE + lane] = bt[pos / 64];
    }
}

// Warp 0, with the copies of tile t0: the pages of tile t0 + LAG·TILE (its positions came LAG
// tiles ago, by this same thread) and the positions of tile t0 + 2·LAG·TILE. Padding has no page.
template <int TILE, int LAG>
__device__ __forceinline__ void sparse_ring_ahead(int* ring, const int* list, const int* bt, int t0, int t_end, int lane) {
    if (lane >= TILE) return;
    int* next = sparse_slot<TILE>(ring, t0 + LAG * TILE);
    const int pos = next[lane];
    if (pos >= 0) cp_async4(smem_addr(next + TILE + lane), bt + pos / 64);
    const int i = t0 + 2 * LAG * TILE + lane;
    int* later = sparse_slot<TILE>(ring, t0 + 2 * LAG * TILE);
    if (i < t_end)
        cp_async4(smem_addr(later + lane), list + i);
    else
        later[lane] = -1;
}

// The cache row of entry t0 + lane from the ring, or -1 for padding, entries past the end and
// lanes past TILE.
template <int TILE> __device__ __forceinline__ int sparse_ring_row(int* ring, int t0, int lane) {
    const int* slot = sparse_slot<TILE>(ring, t0);
    const int pos = slot[lane % TILE], page = slot[TILE + lane % TILE];
    return lane < TILE && pos >= 0 ? page * 64 + pos % 64 : -1;
}
