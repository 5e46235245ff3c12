/* Segment arena: serves a caching allocator's segment requests (torch's
 * CUDAPluggableAllocator / MemPool) from one reserved virtual range whose low
 * part [base, base + limit) is mapped by Python (memory_ext/pool/segment_arena.py).
 *
 * Invariants (all under `lock`):
 *  - blocks[0..nblocks) are the live arena segments, sorted by offset, disjoint,
 *    each inside [0, limit);
 *  - memx_arena_set_limit never moves the limit below the end of a live block,
 *    so Python may unmap everything at or above the limit;
 *  - a request that does not fit below the limit goes to the overflow allocator
 *    (cuMemAlloc_v2 on CUDA) when one is set, else fails with NULL; frees of
 *    pointers outside the range go to the overflow free (cuMemFree_v2);
 *  - before a freed arena segment can be handed out again, the sync hook
 *    (cuCtxSynchronize on CUDA) has run, as cudaFree would have synchronised.
 * No CUDA header is needed: the driver entry points arrive as plain pointers.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*overflow_alloc_fn)(uint64_t *ptr, size_t size); /* cuMemAlloc_v2 */
typedef int (*overflow_free_fn)(uint64_t ptr);                /* cuMemFree_v2 */
typedef int (*sync_fn)(void);                                 /* cuCtxSynchronize */

typedef struct { uint64_t offset, size; } block_t;

enum {
    ST_ALLOCS, ST_FREES, ST_LIVE_BLOCKS, ST_LIVE_BYTES, ST_OVERFLOW_ALLOCS,
    ST_OVERFLOW_LIVE_BYTES, ST_FAILED, ST_BAD_FREES, ST_PEAK_BYTES, ST_SYNCS, ST_COUNT
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t base, capacity, limit, align = 512;
static block_t *blocks;
static size_t nblocks, maxblocks;
static overflow_alloc_fn overflow_alloc;
static overflow_free_fn overflow_free;
static sync_fn sync_hook;
static int dirty; /* a segment was freed since the last sync */
static uint64_t stats[ST_COUNT];

/* (Re)arm the arena over [base, base + capacity), nothing mapped yet. Refused (-1)
 * while any arena or overflow segment is live; -2 on bad arguments or no memory. */
int memx_arena_init(uint64_t new_base, uint64_t new_capacity, uint64_t new_align, uint64_t max_blocks,
                    void *alloc_fn, void *free_fn, void *sync) {
    int rc = 0;
    pthread_mutex_lock(&lock);
    if (nblocks || stats[ST_OVERFLOW_LIVE_BYTES]) {
        rc = -1;
    } else if (!new_capacity || !new_align || (new_align & (new_align - 1)) || !max_blocks
               || new_base % new_align) {
        rc = -2;
    } else {
        block_t *fresh = calloc(max_blocks, sizeof(block_t));
        if (!fresh) {
            rc = -2;
        } else {
            free(blocks);
            blocks = fresh;
            maxblocks = max_blocks;
            base = new_base;
            capacity = new_capacity;
            align = new_align;
            limit = 0;
            overflow_alloc = (overflow_alloc_fn)alloc_fn;
            overflow_free = (overflow_free_fn)free_fn;
            sync_hook = (sync_fn)sync;
            dirty = 0;
            memset(stats, 0, sizeof(stats));
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Smallest gap of at least `size` bytes below the limit (ties: lowest offset). */
static int best_fit(uint64_t size, uint64_t *offset, size_t *index) {
    uint64_t best_len = UINT64_MAX, prev_end = 0;
    int found = 0;
    for (size_t i = 0; i <= nblocks; i++) {
        uint64_t next = i < nblocks ? blocks[i].offset : limit;
        if (next > prev_end && next - prev_end >= size && next - prev_end < best_len) {
            best_len = next - prev_end;
            *offset = prev_end;
            *index = i;
            found = 1;
        }
        if (i < nblocks)
            prev_end = blocks[i].offset + blocks[i].size;
    }
    return found;
}

void *memx_arena_alloc(size_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    void *out = NULL;
    uint64_t rounded, offset = 0;
    size_t at = 0;
    pthread_mutex_lock(&lock);
    rounded = size ? (size + align - 1) & ~(align - 1) : align;
    if (blocks && nblocks < maxblocks && best_fit(rounded, &offset, &at)) {
        if (dirty && sync_hook) { /* freed ranges may still be in use by queued work */
            sync_hook();
            stats[ST_SYNCS]++;
        }
        dirty = 0;
        memmove(&blocks[at + 1], &blocks[at], (nblocks - at) * sizeof(block_t));
        blocks[at].offset = offset;
        blocks[at].size = rounded;
        nblocks++;
        stats[ST_ALLOCS]++;
        stats[ST_LIVE_BLOCKS] = nblocks;
        stats[ST_LIVE_BYTES] += rounded;
        if (stats[ST_LIVE_BYTES] > stats[ST_PEAK_BYTES])
            stats[ST_PEAK_BYTES] = stats[ST_LIVE_BYTES];
        out = (void *)(uintptr_t)(base + offset);
    } else if (overflow_alloc) {
        uint64_t ptr = 0;
        if (overflow_alloc(&ptr, size) == 0 && ptr) {
            stats[ST_OVERFLOW_ALLOCS]++;
            stats[ST_OVERFLOW_LIVE_BYTES] += size;
            out = (void *)(uintptr_t)ptr;
        } else {
            stats[ST_FAILED]++;
        }
    } else {
        stats[ST_FAILED]++;
    }
    pthread_mutex_unlock(&lock);
    return out;
}

void memx_arena_free(void *ptr, size_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    uint64_t p = (uint64_t)(uintptr_t)ptr;
    pthread_mutex_lock(&lock);
    if (blocks && p >= base && p < base + capacity) {
        uint64_t offset = p - base;
        size_t lo = 0, hi = nblocks; /* binary search by offset */
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (blocks[mid].offset < offset) lo = mid + 1; else hi = mid;
        }
        if (lo < nblocks && blocks[lo].offset == offset) {
            stats[ST_LIVE_BYTES] -= blocks[lo].size;
            memmove(&blocks[lo], &blocks[lo + 1], (nblocks - lo - 1) * sizeof(block_t));
            nblocks--;
            stats[ST_FREES]++;
            stats[ST_LIVE_BLOCKS] = nblocks;
            dirty = 1;
        } else {
            stats[ST_BAD_FREES]++;
        }
    } else if (ptr && overflow_free && stats[ST_OVERFLOW_LIVE_BYTES] >= size) {
        overflow_free(p);
        stats[ST_OVERFLOW_LIVE_BYTES] -= size;
        stats[ST_FREES]++;
    } else if (ptr) {
        stats[ST_BAD_FREES]++;
    }
    pthread_mutex_unlock(&lock);
}

/* Move the mapped limit. Returns the new limit, or -1 if a live block ends above
 * `new_limit` or `new_limit` exceeds the capacity (nothing changes then). */
int64_t memx_arena_set_limit(uint64_t new_limit) {
    int64_t rc;
    pthread_mutex_lock(&lock);
    uint64_t top = nblocks ? blocks[nblocks - 1].offset + blocks[nblocks - 1].size : 0;
    if (new_limit > capacity || new_limit < top) {
        rc = -1;
    } else {
        limit = new_limit;
        rc = (int64_t)limit;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* The caller has synchronised the device: freed ranges may be reused without a sync. */
void memx_arena_mark_synced(void) {
    pthread_mutex_lock(&lock);
    dirty = 0;
    pthread_mutex_unlock(&lock);
}

/* End offset of the highest live arena block (0 when none). */
uint64_t memx_arena_high_water(void) {
    pthread_mutex_lock(&lock);
    uint64_t top = nblocks ? blocks[nblocks - 1].offset + blocks[nblocks - 1].size : 0;
    pthread_mutex_unlock(&lock);
    return top;
}

/* Copy the ST_COUNT counters into `out`; returns ST_COUNT. */
int memx_arena_stats(uint64_t *out) {
    pthread_mutex_lock(&lock);
    memcpy(out, stats, sizeof(stats));
    pthread_mutex_unlock(&lock);
    return ST_COUNT;
}
