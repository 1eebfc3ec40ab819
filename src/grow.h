/* Growing a malloc'd array by doubling, shared by the parsers that build
 * lists of unknown length (pattern programs, pickle objects). */
#ifndef NF4DEQ_GROW_H
#define NF4DEQ_GROW_H

#include <stdint.h>
#include <stdlib.h>

/* Makes *items (of *cap elements of `size` bytes) hold at least `need`:
 * 1, or 0 when out of memory or the size would overflow (*items untouched). */
static inline int grow_array(void **items, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return 1;
    size_t n = *cap ? *cap : 4;
    while (n < need) {
        if (n > SIZE_MAX / 2)
            return 0;
        n *= 2;
    }
    if (n > SIZE_MAX / size)
        return 0;
    void *p = realloc(*items, n * size);
    if (!p)
        return 0;
    *items = p;
    *cap = n;
    return 1;
}

#endif
