#include "mapped_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

struct mapped_writer {
    int fd;
    uint64_t start, len;
    unsigned char *map;  /* the file from offset 0 to start + len */
    size_t map_len;
    size_t page;
    pthread_mutex_t mu;  /* held by the one thread extending `reserved` */
    _Atomic uint64_t reserved; /* bytes of the data region allocated (from start) */
    size_t released;     /* bytes of the mapping dropped from the page tables */
};

int mapped_writer_wanted(int fd, const char *dir, int threads)
{
    const char *force = getenv(OUTPUT_MAP_ENV);
    if (force && strcmp(force, "1") == 0)
        return 1;
    if (force && strcmp(force, "0") == 0)
        return 0;
    if (threads < MAPPED_WRITER_MIN_THREADS)
        return 0;
    struct statfs fs;
    int ok = fd >= 0 ? fstatfs(fd, &fs) == 0 : statfs(dir, &fs) == 0;
    return ok && fs.f_type == TMPFS_MAGIC;
}

int mapped_writer_open(struct mapped_writer **out, int fd, uint64_t start, uint64_t len)
{
    *out = NULL;
    if (len == 0 || start > SIZE_MAX - len)
        return EINVAL;
    struct mapped_writer *m = calloc(1, sizeof *m);
    if (!m)
        return ENOMEM;
    m->fd = fd;
    m->start = start;
    m->len = len;
    m->map_len = (size_t)(start + len);
    long page = sysconf(_SC_PAGESIZE);
    m->page = page > 0 ? (size_t)page : 4096;
    /* Past the file's end the mapping is only an address range: nothing touches
     * a page of it before fallocate has put the page inside the file. */
    void *map = mmap(NULL, m->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        int err = errno;
        free(m);
        return err;
    }
    m->map = map;
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return 0;
}

/* Makes sure [0, end) of the data region is allocated in the file. */
static int reserve(struct mapped_writer *m, uint64_t end)
{
    int err = 0;
    pthread_mutex_lock(&m->mu);
    uint64_t reserved = atomic_load(&m->reserved);
    while (reserved < end) {
        uint64_t step = m->len - reserved < MAPPED_WRITER_RESERVE_STEP ? m->len - reserved
                                                                       : MAPPED_WRITER_RESERVE_STEP;
        /* A stop and continue (Ctrl-Z, a cgroup freezer) can interrupt it on
         * some kernels; reserving the same range again is harmless. */
        int r;
        do
            r = fallocate(m->fd, 0, (off_t)(m->start + reserved), (off_t)step);
        while (r != 0 && errno == EINTR);
        if (r != 0) {
            err = errno;
            break;
        }
        reserved += step;
        atomic_store(&m->reserved, reserved);
    }
    pthread_mutex_unlock(&m->mu);
    return err;
}

int mapped_writer_write(struct mapped_writer *m, uint64_t at, const void *buf, size_t len)
{
    if (at > m->len || len > m->len - at)
        return EINVAL;
    /* Read without the lock: a copy into space already reserved never waits
     * for the thread that is reserving more. */
    if (atomic_load(&m->reserved) < at + len) {
        int err = reserve(m, at + len);
        if (err)
            return err;
    }
    unsigned char *dst = m->map + m->start + at;
    memcpy(dst, buf, len);
    /* Its whole pages leave the page tables at once (mapped_writer_release
     * takes the edge pages, which a neighbour's copy may still be filling). */
    uintptr_t first = ((uintptr_t)dst + m->page - 1) / m->page * m->page;
    uintptr_t last = ((uintptr_t)dst + len) / m->page * m->page;
    if (last > first)
        madvise((void *)first, last - first, MADV_DONTNEED);
    return 0;
}

void mapped_writer_release(struct mapped_writer *m, uint64_t end)
{
    /* Whole pages only: the one `end` falls in still waits for its next bytes. */
    uintptr_t base = (uintptr_t)m->map;
    uintptr_t to = (base + (uintptr_t)(m->start + (end < m->len ? end : m->len))) / m->page * m->page;
    if (to > base + m->released) {
        madvise((void *)(base + m->released), to - (base + m->released), MADV_DONTNEED);
        m->released = to - base;
    }
}

int mapped_writer_close(struct mapped_writer *m)
{
    if (!m)
        return 0;
    int err = munmap(m->map, m->map_len) != 0 ? errno : 0;
    pthread_mutex_destroy(&m->mu);
    free(m);
    return err;
}
