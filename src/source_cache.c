#include "source_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "safetensors.h"
#include "status.h"

#define PART_ALIGN 64u

enum entry_state { ENTRY_EMPTY, ENTRY_LOADING, ENTRY_READY };

struct entry {
    const struct bnb_weight *w;
    enum entry_state state;
    int users;
    uint64_t last_use;
    unsigned char *buf;
    struct cached_source view;
};

struct source_cache {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t entry_bytes;
    uint64_t clock;
    unsigned char *arena;
    struct entry entries[SOURCE_CACHE_ENTRIES];
};

static uint64_t align_up(uint64_t v)
{
    return (v + PART_ALIGN - 1) / PART_ALIGN * PART_ALIGN;
}

static uint64_t packed_bytes(const struct bnb_weight *w)
{
    return w->state.n / 2 + (w->state.n & 1);
}

static uint64_t absmax_bytes(const struct bnb_weight *w)
{
    return w->blocks * (w->state.nested ? 1 : 4);
}

uint64_t source_cache_entry_bytes(const struct bnb_weight *w)
{
    return align_up(packed_bytes(w)) + align_up(absmax_bytes(w)) + (w->state.nested ? w->nested_blocks * 4 : 0);
}

int source_cache_create(struct source_cache **out, uint64_t entry_bytes, const char *path)
{
    *out = NULL;
    if (entry_bytes > SOURCE_CACHE_MAX_BYTES)
        entry_bytes = SOURCE_CACHE_MAX_BYTES;
    struct source_cache *c = calloc(1, sizeof *c);
    if (!c)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    c->entry_bytes = align_up(entry_bytes);
    void *arena = mmap(NULL, (size_t)(c->entry_bytes * SOURCE_CACHE_ENTRIES), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena == MAP_FAILED) {
        free(c);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory for the transposed tensors' cache");
    }
    c->arena = arena;
    for (int i = 0; i < SOURCE_CACHE_ENTRIES; i++)
        c->entries[i].buf = c->arena + (uint64_t)i * c->entry_bytes;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    *out = c;
    return NF4_OK;
}

void source_cache_destroy(struct source_cache *c)
{
    if (!c)
        return;
    munmap(c->arena, (size_t)(c->entry_bytes * SOURCE_CACHE_ENTRIES));
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

void source_cache_clear(struct source_cache *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < SOURCE_CACHE_ENTRIES; i++)
        c->entries[i] = (struct entry){.buf = c->entries[i].buf};
    pthread_mutex_unlock(&c->mu);
}

/* w's entry, if it has one; with mu held. */
static struct entry *find(struct source_cache *c, const struct bnb_weight *w)
{
    for (int i = 0; i < SOURCE_CACHE_ENTRIES; i++)
        if (c->entries[i].w == w && c->entries[i].state != ENTRY_EMPTY)
            return &c->entries[i];
    return NULL;
}

/* The entry no chunk uses that was used longest ago, or NULL; with mu held. */
static struct entry *free_entry(struct source_cache *c)
{
    struct entry *best = NULL;
    for (int i = 0; i < SOURCE_CACHE_ENTRIES; i++) {
        struct entry *e = &c->entries[i];
        if (e->users == 0 && e->state != ENTRY_LOADING && (!best || e->last_use < best->last_use))
            best = e;
    }
    return best;
}

int source_read_whole(const struct bnb_weight *w, unsigned char *buf, struct cached_source *view)
{
    unsigned char *at = buf;
    view->packed = at;
    int code = st_read(w->packed->file, w->packed->t, 0, at, packed_bytes(w));
    at += align_up(packed_bytes(w));
    view->absmax = at;
    if (code == NF4_OK)
        code = st_read(w->absmax->file, w->absmax->t, 0, at, absmax_bytes(w));
    at += align_up(absmax_bytes(w));
    view->nested_absmax = w->state.nested ? (const float *)at : NULL;
    if (code == NF4_OK && w->state.nested)
        code = st_read(w->nested_absmax->file, w->nested_absmax->t, 0, at, w->nested_blocks * 4);
    return code;
}

int source_cache_get(struct source_cache *c, const struct bnb_weight *w, const struct cached_source **held)
{
    *held = NULL;
    if (!c || source_cache_entry_bytes(w) > c->entry_bytes)
        return NF4_OK;
    pthread_mutex_lock(&c->mu);
    struct entry *e;
    while ((e = find(c, w)) && e->state == ENTRY_LOADING)
        pthread_cond_wait(&c->cv, &c->mu);
    if (!e && (e = free_entry(c))) {
        /* Read it here, without the lock: its readers wait for it. */
        *e = (struct entry){.w = w, .state = ENTRY_LOADING, .buf = e->buf};
        pthread_mutex_unlock(&c->mu);
        int code = source_read_whole(w, e->buf, &e->view);
        pthread_mutex_lock(&c->mu);
        e->state = code == NF4_OK ? ENTRY_READY : ENTRY_EMPTY;
        pthread_cond_broadcast(&c->cv);
        if (code != NF4_OK) {
            pthread_mutex_unlock(&c->mu);
            return code;
        }
    }
    if (e && e->state == ENTRY_READY) {
        e->users++;
        e->last_use = ++c->clock;
        *held = &e->view;
    }
    pthread_mutex_unlock(&c->mu);
    return NF4_OK;
}

void source_cache_put(struct source_cache *c, const struct cached_source *held)
{
    if (!c || !held)
        return;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < SOURCE_CACHE_ENTRIES; i++)
        if (&c->entries[i].view == held)
            c->entries[i].users--;
    pthread_mutex_unlock(&c->mu);
}
