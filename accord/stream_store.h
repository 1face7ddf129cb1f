/* Copies with streaming (non-temporal) stores, shared by accord's optional C helpers
 * (copy_core.c, transport/ring_core.c).
 *
 * stream_store_copy(dst, src, n): dst[0:n] = src[0:n], the 64-byte blocks from the
 * first 16-byte aligned byte of dst written with SSE2 streaming stores (x86-64;
 * memcpy elsewhere), the bytes before and after them by memcpy. Streaming stores
 * are weakly ordered: call stream_store_fence() before anything that tells another
 * process the bytes are there. STREAM_STORES says whether this build streams. */
#ifndef ACCORD_STREAM_STORE_H
#define ACCORD_STREAM_STORE_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAM_STORES 1
#else
#define STREAM_STORES 0
#endif

static inline void stream_store_copy(void *dst_, const void *src_, size_t n)
{
    unsigned char *dst = (unsigned char *)dst_;
    const unsigned char *src = (const unsigned char *)src_;
#if STREAM_STORES
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

static inline void stream_store_fence(void)
{
#if STREAM_STORES
    _mm_sfence();
#endif
}

#endif
