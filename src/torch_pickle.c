/* A pickle machine for state dicts (pickletools.py documents each opcode). */
#include "torch_pickle.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "grow.h"
#include "safetensors.h" /* checked_mul_u64, checked_add_u64 */
#include "status.h"
#include "strutil.h"

/* Opcodes (protocols 2 to 5) that torch.save writes for a dict of tensors. */
enum {
    OP_MARK = '(', OP_STOP = '.', OP_BININT = 'J', OP_BININT1 = 'K', OP_BININT2 = 'M', OP_NONE = 'N',
    OP_BINPERSID = 'Q', OP_REDUCE = 'R', OP_BINUNICODE = 'X', OP_APPEND = 'a', OP_BUILD = 'b', OP_GLOBAL = 'c',
    OP_DICT = 'd', OP_APPENDS = 'e', OP_BINGET = 'h', OP_LONG_BINGET = 'j', OP_LIST = 'l', OP_BINPUT = 'q',
    OP_LONG_BINPUT = 'r', OP_SETITEM = 's', OP_TUPLE = 't', OP_SETITEMS = 'u', OP_EMPTY_DICT = '}',
    OP_EMPTY_LIST = ']', OP_EMPTY_TUPLE = ')', OP_PROTO = 0x80, OP_TUPLE1 = 0x85, OP_TUPLE2 = 0x86,
    OP_TUPLE3 = 0x87, OP_NEWTRUE = 0x88, OP_NEWFALSE = 0x89, OP_LONG1 = 0x8a, OP_SHORT_BINUNICODE = 0x8c,
    OP_BINUNICODE8 = 0x8d, OP_STACK_GLOBAL = 0x93, OP_MEMOIZE = 0x94, OP_FRAME = 0x95,
};
#define MIN_PROTOCOL 2
#define MAX_PROTOCOL 5
/* A GLOBAL's module and name lines; real ones are a few dozen characters. */
#define MAX_GLOBAL_LINE 256

enum value_kind { V_NONE, V_BOOL, V_INT, V_STR, V_TUPLE, V_LIST, V_DICT, V_CALLABLE, V_STORAGE, V_TENSOR };
enum callable {
    CALL_ORDERED_DICT, CALL_REBUILD_TENSOR, CALL_REBUILD_PARAMETER, CALL_STORAGE_TYPE,
};

struct value {
    enum value_kind kind;
    int64_t i;               /* V_BOOL, V_INT; V_STORAGE and V_TENSOR: elements; V_TENSOR: offset in u */
    uint64_t u;
    enum callable call;      /* V_CALLABLE */
    enum st_dtype dtype;     /* V_CALLABLE of a storage type, V_STORAGE, V_TENSOR */
    char *s;                 /* V_STR (NUL-free), V_STORAGE: its key */
    size_t len;
    struct value **items;    /* V_TUPLE, V_LIST; V_DICT: key, value, key, value...; V_TENSOR: its storage */
    size_t n, cap;
    uint64_t *shape;         /* V_TENSOR */
    size_t ndim;
};

struct machine {
    const char *path;
    const unsigned char *p;
    size_t len, at, op_at;
    struct value **all;      /* every value made, for the free */
    size_t nall, capall;
    struct value **stack;
    size_t sp, capstack;
    size_t *marks;
    size_t nmarks, capmarks;
    struct value **memo;
    size_t nmemo, capmemo;
    int failed; /* why new_value returned NULL */
    size_t dims; /* tensor dimensions made and copied out, within len: see rebuild_tensor */
};

static const char *kind_name(enum value_kind k)
{
    static const char *const NAMES[] = {"None", "bool", "int", "str", "tuple", "list", "dict", "callable",
                                        "storage", "tensor"};
    return NAMES[k];
}

static int bad(struct machine *m, const char *what)
{
    return nf4_fail(NF4_EDATA, m->path, NULL, "pickle opcode 0x%02x at byte %zu: %s", m->p[m->op_at], m->op_at,
                    what);
}

static int oom(struct machine *m)
{
    return nf4_fail(NF4_ESOFTWARE, m->path, NULL, "out of memory");
}

static struct value *new_value(struct machine *m, enum value_kind kind)
{
    if (m->nall >= TORCH_MAX_PICKLE_VALUES) {
        m->failed = nf4_fail(NF4_EDATA, m->path, NULL, "pickle makes more than %u objects",
                             TORCH_MAX_PICKLE_VALUES);
        return NULL;
    }
    struct value *v = calloc(1, sizeof *v);
    if (!v || !grow_array((void **)&m->all, &m->capall, m->nall + 1, sizeof *m->all)) {
        free(v);
        m->failed = oom(m);
        return NULL;
    }
    m->all[m->nall++] = v;
    v->kind = kind;
    return v;
}

static int push(struct machine *m, struct value *v)
{
    if (!v)
        return m->failed;
    if (!grow_array((void **)&m->stack, &m->capstack, m->sp + 1, sizeof *m->stack))
        return oom(m);
    m->stack[m->sp++] = v;
    return NF4_OK;
}

/* The bottom of the stack as the innermost MARK leaves it. */
static size_t floor_of_stack(const struct machine *m)
{
    return m->nmarks ? m->marks[m->nmarks - 1] : 0;
}

static struct value *pop(struct machine *m)
{
    if (m->sp <= floor_of_stack(m)) {
        bad(m, "the stack is empty");
        return NULL;
    }
    return m->stack[--m->sp];
}

static struct value *top(struct machine *m)
{
    if (m->sp <= floor_of_stack(m)) {
        bad(m, "the stack is empty");
        return NULL;
    }
    return m->stack[m->sp - 1];
}

static int append_item(struct machine *m, struct value *to, struct value *item)
{
    if (!grow_array((void **)&to->items, &to->cap, to->n + 1, sizeof *to->items))
        return oom(m);
    to->items[to->n++] = item;
    return NF4_OK;
}

/* Moves the stack above the innermost MARK into `to`'s items, and drops the mark. */
static int take_marked(struct machine *m, struct value *to)
{
    if (!m->nmarks)
        return bad(m, "no MARK before it");
    size_t from = m->marks[--m->nmarks];
    for (size_t k = from; k < m->sp; k++) {
        int code = append_item(m, to, m->stack[k]);
        if (code != NF4_OK)
            return code;
    }
    m->sp = from;
    return NF4_OK;
}

/* The opcode's argument: n bytes, or a failure when fewer are left. */
static const unsigned char *arg(struct machine *m, size_t n)
{
    if (n > m->len - m->at) {
        bad(m, "its argument runs past the end of the pickle");
        return NULL;
    }
    const unsigned char *q = m->p + m->at;
    m->at += n;
    return q;
}

static uint64_t le_uint(const unsigned char *q, size_t n)
{
    uint64_t x = 0;
    for (size_t k = n; k-- > 0;)
        x = x << 8 | q[k];
    return x;
}

/* A new value of a kind that holds no more than i (None, a bool, an int, an empty list or dict). */
static int push_kind(struct machine *m, enum value_kind kind, int64_t i)
{
    struct value *v = new_value(m, kind);
    if (v)
        v->i = i;
    return push(m, v);
}

/* LONG1: a two's-complement little-endian integer of up to 8 bytes here. */
static int op_long1(struct machine *m)
{
    const unsigned char *n = arg(m, 1), *q;
    if (!n || !(q = arg(m, *n)))
        return NF4_EDATA;
    if (*n > 8)
        return bad(m, "an integer of more than 64 bits");
    uint64_t x = le_uint(q, *n);
    if (*n && *n < 8 && (q[*n - 1] & 0x80))
        x |= ~UINT64_C(0) << (8 * *n); /* sign extension */
    return push_kind(m, V_INT, (int64_t)x);
}

static int push_string(struct machine *m, size_t n)
{
    const unsigned char *q = arg(m, n);
    if (!q)
        return NF4_EDATA;
    if (memchr(q, 0, n) || !utf8_is_valid(q, n))
        return bad(m, "a string that is not UTF-8 without NUL");
    struct value *v = new_value(m, V_STR);
    if (v && !(v->s = strndup((const char *)q, n)))
        return oom(m);
    if (v)
        v->len = n;
    return push(m, v);
}

static int op_binunicode(struct machine *m, size_t width)
{
    const unsigned char *q = arg(m, width);
    if (!q)
        return NF4_EDATA;
    uint64_t n = le_uint(q, width);
    if (n > m->len - m->at)
        return bad(m, "its string runs past the end of the pickle");
    return push_string(m, (size_t)n);
}

static const struct {
    const char *name;
    enum st_dtype dtype;
} STORAGE_TYPES[] = {
    {"FloatStorage", DT_F32}, {"HalfStorage", DT_F16}, {"BFloat16Storage", DT_BF16}, {"DoubleStorage", DT_F64},
    {"ByteStorage", DT_U8},   {"CharStorage", DT_I8},  {"ShortStorage", DT_I16},    {"IntStorage", DT_I32},
    {"LongStorage", DT_I64},  {"BoolStorage", DT_BOOL},
};

/* The callables a state dict is built with; anything else is refused unrun. */
static int push_global(struct machine *m, const char *module, const char *name)
{
    struct value *v = new_value(m, V_CALLABLE);
    if (!v)
        return m->failed;
    if (strcmp(module, "collections") == 0 && strcmp(name, "OrderedDict") == 0) {
        v->call = CALL_ORDERED_DICT;
        return push(m, v);
    }
    if (strcmp(module, "torch._utils") == 0 && strcmp(name, "_rebuild_tensor_v2") == 0) {
        v->call = CALL_REBUILD_TENSOR;
        return push(m, v);
    }
    if (strcmp(module, "torch._utils") == 0 && strcmp(name, "_rebuild_parameter") == 0) {
        v->call = CALL_REBUILD_PARAMETER;
        return push(m, v);
    }
    if (strcmp(module, "torch") == 0)
        for (size_t k = 0; k < sizeof STORAGE_TYPES / sizeof *STORAGE_TYPES; k++)
            if (strcmp(name, STORAGE_TYPES[k].name) == 0) {
                v->call = CALL_STORAGE_TYPE;
                v->dtype = STORAGE_TYPES[k].dtype;
                return push(m, v);
            }
    return nf4_fail(NF4_EDATA, m->path, NULL, "the pickle calls %s.%s (at byte %zu), which a state dict of "
                    "tensors does not: nf4deq runs nothing a pickle names", module, name, m->op_at);
}

/* GLOBAL: "module\nname\n". */
static int op_global(struct machine *m)
{
    char parts[2][MAX_GLOBAL_LINE + 1];
    for (int k = 0; k < 2; k++) {
        const unsigned char *start = m->p + m->at;
        const unsigned char *nl = memchr(start, '\n', m->len - m->at);
        if (!nl || nl - start > MAX_GLOBAL_LINE || memchr(start, 0, (size_t)(nl - start)))
            return bad(m, "a module or name line that is cut short, too long or holds a NUL");
        memcpy(parts[k], start, (size_t)(nl - start));
        parts[k][nl - start] = '\0';
        m->at += (size_t)(nl - start) + 1;
    }
    return push_global(m, parts[0], parts[1]);
}

static int op_stack_global(struct machine *m)
{
    struct value *name = pop(m), *module = name ? pop(m) : NULL;
    if (!module)
        return NF4_EDATA;
    if (module->kind != V_STR || name->kind != V_STR)
        return bad(m, "its module and name are not strings");
    return push_global(m, module->s, name->s);
}

static int memo_put(struct machine *m, uint64_t key)
{
    struct value *v = top(m);
    if (!v)
        return NF4_EDATA;
    /* Picklers number memo entries in order; a key past the next one would
     * make a hostile pickle's memo as large as it says. */
    if (key > m->nmemo)
        return bad(m, "a memo key out of order");
    if (key == m->nmemo) {
        if (!grow_array((void **)&m->memo, &m->capmemo, m->nmemo + 1, sizeof *m->memo))
            return oom(m);
        m->nmemo++;
    }
    m->memo[key] = v;
    return NF4_OK;
}

static int memo_get(struct machine *m, uint64_t key)
{
    if (key >= m->nmemo)
        return bad(m, "a memo key never put");
    return push(m, m->memo[key]);
}

static int make_tuple(struct machine *m, size_t n)
{
    if (m->sp - floor_of_stack(m) < n)
        return bad(m, "the stack holds too few items");
    struct value *t = new_value(m, V_TUPLE);
    if (!t)
        return m->failed;
    for (size_t k = m->sp - n; k < m->sp; k++) {
        int code = append_item(m, t, m->stack[k]);
        if (code != NF4_OK)
            return code;
    }
    m->sp -= n;
    return push(m, t);
}

static int from_mark(struct machine *m, enum value_kind kind)
{
    struct value *v = new_value(m, kind);
    if (!v)
        return m->failed;
    int code = take_marked(m, v);
    if (code == NF4_OK && kind == V_DICT && v->n % 2)
        return bad(m, "a key without a value");
    return code != NF4_OK ? code : push(m, v);
}

/* APPEND(S), SETITEM(S): items above the mark (or the last one or two) go into
 * the container below them. */
static int add_items(struct machine *m, enum value_kind kind, int marked, size_t n)
{
    struct value tmp = {0};
    int code = NF4_OK;
    if (marked) {
        code = take_marked(m, &tmp);
    } else if (m->sp - floor_of_stack(m) < n + 1) {
        code = bad(m, "the stack holds too few items");
    } else {
        for (size_t k = m->sp - n; k < m->sp && code == NF4_OK; k++)
            code = append_item(m, &tmp, m->stack[k]);
        m->sp -= n;
    }
    struct value *to = code == NF4_OK ? top(m) : NULL;
    if (code == NF4_OK && !to)
        code = NF4_EDATA;
    if (code == NF4_OK && to->kind != kind)
        code = bad(m, kind == V_DICT ? "items set on something not a dict" : "items appended to something not a list");
    if (code == NF4_OK && kind == V_DICT && tmp.n % 2)
        code = bad(m, "a key without a value");
    for (size_t k = 0; k < tmp.n && code == NF4_OK; k++)
        code = append_item(m, to, tmp.items[k]);
    free(tmp.items);
    return code;
}

static int get_index(const struct value *v, uint64_t *out)
{
    if (v->kind != V_INT || v->i < 0)
        return 0;
    *out = (uint64_t)v->i;
    return 1;
}

/* BINPERSID: ("storage", torch.XStorage, key, location, elements). */
static int op_binpersid(struct machine *m)
{
    struct value *pid = pop(m);
    if (!pid)
        return NF4_EDATA;
    struct value **t = pid->items;
    uint64_t elems;
    if (pid->kind != V_TUPLE || pid->n != 5 || t[0]->kind != V_STR || strcmp(t[0]->s, "storage") != 0 ||
        t[1]->kind != V_CALLABLE || t[1]->call != CALL_STORAGE_TYPE || t[2]->kind != V_STR || t[3]->kind != V_STR ||
        !get_index(t[4], &elems))
        return bad(m, "a persistent id that is not (\"storage\", type, key, location, elements)");
    /* torch numbers its storages: a key is a few digits. Every tensor's record
     * copies its storage's key, so a long one shared by many would add up. */
    if (!t[2]->len || t[2]->len > TORCH_MAX_STORAGE_KEY || strchr(t[2]->s, '/') || strcmp(t[2]->s, ".") == 0 ||
        strcmp(t[2]->s, "..") == 0)
        return bad(m, "a storage key that is not a plain entry name of at most 64 bytes");
    struct value *s = new_value(m, V_STORAGE);
    if (!s)
        return m->failed;
    s->dtype = t[1]->dtype;
    s->s = t[2]->s; /* owned by the string value */
    s->u = elems;
    return push(m, s);
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]). */
static int rebuild_tensor(struct machine *m, const struct value *args)
{
    struct value **a = args->items;
    uint64_t offset;
    if ((args->n != 6 && args->n != 7) || a[0]->kind != V_STORAGE || !get_index(a[1], &offset) ||
        a[2]->kind != V_TUPLE || a[3]->kind != V_TUPLE || a[2]->n != a[3]->n || a[4]->kind != V_BOOL ||
        a[5]->kind != V_DICT)
        return bad(m, "_rebuild_tensor_v2 without (storage, offset, size, stride, requires_grad, hooks)");
    /* Metadata, where there is any, changes what the bytes mean. */
    if (args->n == 7 && (a[6]->kind != V_DICT || a[6]->n))
        return bad(m, "a tensor with metadata (a conjugate, negative or other view)");
    if (a[2]->n > TORCH_MAX_DIMS)
        return bad(m, "a tensor of more than 64 dimensions");
    /* A size tuple can be reused through the memo, two bytes a tensor: the
     * shapes made must stay within the pickle's size. A real pickle writes
     * each tensor's sizes anew, two bytes or more apiece. */
    m->dims += a[2]->n;
    if (m->dims > m->len)
        return bad(m, "more tensor dimensions than the pickle has bytes");
    struct value *t = new_value(m, V_TENSOR);
    if (!t)
        return m->failed;
    t->ndim = a[2]->n;
    t->shape = calloc(t->ndim ? t->ndim : 1, sizeof *t->shape);
    uint64_t *stride = calloc(t->ndim ? t->ndim : 1, sizeof *stride);
    int code = t->shape && stride ? NF4_OK : oom(m);
    for (size_t d = 0; d < t->ndim && code == NF4_OK; d++)
        if (!get_index(a[2]->items[d], &t->shape[d]) || !get_index(a[3]->items[d], &stride[d]))
            code = bad(m, "a size or stride that is not a non-negative integer");
    uint64_t nelem = 1;
    for (size_t d = 0; d < t->ndim && code == NF4_OK; d++)
        if (!checked_mul_u64(nelem, t->shape[d], &nelem))
            code = bad(m, "a tensor whose element count overflows");
    /* Contiguous, as torch sees it: a dimension of one may have any stride. */
    uint64_t expect = 1;
    for (size_t d = t->ndim; d-- > 0 && code == NF4_OK && nelem;) {
        if (t->shape[d] != 1 && stride[d] != expect)
            code = bad(m, "a tensor that is not contiguous (save it with .contiguous())");
        expect *= t->shape[d];
    }
    free(stride);
    if (code != NF4_OK)
        return code;
    t->i = (int64_t)nelem;
    t->u = offset;
    t->dtype = a[0]->dtype;
    if (!grow_array((void **)&t->items, &t->cap, 1, sizeof *t->items))
        return oom(m);
    t->items[0] = a[0];
    t->n = 1;
    return push(m, t);
}

static int op_reduce(struct machine *m)
{
    struct value *args = pop(m), *fn = args ? pop(m) : NULL;
    if (!fn)
        return NF4_EDATA;
    if (fn->kind != V_CALLABLE || args->kind != V_TUPLE)
        return bad(m, "a call of something not a callable, or without a tuple of arguments");
    switch (fn->call) {
    case CALL_ORDERED_DICT:
        if (args->n != 0)
            return bad(m, "OrderedDict called with arguments");
        return push(m, new_value(m, V_DICT));
    case CALL_REBUILD_TENSOR:
        return rebuild_tensor(m, args);
    case CALL_REBUILD_PARAMETER:
        if (args->n != 3 || args->items[0]->kind != V_TENSOR || args->items[1]->kind != V_BOOL ||
            args->items[2]->kind != V_DICT)
            return bad(m, "_rebuild_parameter without (tensor, requires_grad, hooks)");
        return push(m, args->items[0]);
    case CALL_STORAGE_TYPE:
        break;
    }
    return bad(m, "a storage type called");
}

/* BUILD sets an object's state: torch.save writes it for an OrderedDict with
 * attributes (a state dict's _metadata), which say nothing about tensors. */
static int op_build(struct machine *m)
{
    struct value *state = pop(m), *obj = state ? top(m) : NULL;
    if (!obj)
        return NF4_EDATA;
    if (obj->kind != V_DICT || (state->kind != V_DICT && state->kind != V_NONE))
        return bad(m, "state set on something not a dict");
    return NF4_OK;
}

static int push_mark(struct machine *m)
{
    if (!grow_array((void **)&m->marks, &m->capmarks, m->nmarks + 1, sizeof *m->marks))
        return oom(m);
    m->marks[m->nmarks++] = m->sp;
    return NF4_OK;
}

/* One opcode at m->at. */
static int step(struct machine *m)
{
    m->op_at = m->at;
    const unsigned char *q;
    switch (m->p[m->at++]) {
    case OP_PROTO:
        if (!(q = arg(m, 1)))
            return NF4_EDATA;
        return *q >= MIN_PROTOCOL && *q <= MAX_PROTOCOL ? NF4_OK : bad(m, "a protocol other than 2 to 5");
    case OP_FRAME:
        return arg(m, 8) ? NF4_OK : NF4_EDATA;
    case OP_MARK:
        return push_mark(m);
    case OP_EMPTY_TUPLE:
        return make_tuple(m, 0);
    case OP_TUPLE1:
    case OP_TUPLE2:
    case OP_TUPLE3:
        return make_tuple(m, (size_t)(m->p[m->op_at] - OP_TUPLE1 + 1));
    case OP_TUPLE:
        return from_mark(m, V_TUPLE);
    case OP_EMPTY_LIST:
        return push_kind(m, V_LIST, 0);
    case OP_LIST:
        return from_mark(m, V_LIST);
    case OP_APPEND:
        return add_items(m, V_LIST, 0, 1);
    case OP_APPENDS:
        return add_items(m, V_LIST, 1, 0);
    case OP_EMPTY_DICT:
        return push_kind(m, V_DICT, 0);
    case OP_DICT:
        return from_mark(m, V_DICT);
    case OP_SETITEM:
        return add_items(m, V_DICT, 0, 2);
    case OP_SETITEMS:
        return add_items(m, V_DICT, 1, 0);
    case OP_NONE:
        return push_kind(m, V_NONE, 0);
    case OP_NEWTRUE:
    case OP_NEWFALSE:
        return push_kind(m, V_BOOL, m->p[m->op_at] == OP_NEWTRUE);
    case OP_BININT1:
        return (q = arg(m, 1)) ? push_kind(m, V_INT, *q) : NF4_EDATA;
    case OP_BININT2:
        return (q = arg(m, 2)) ? push_kind(m, V_INT, (int64_t)le_uint(q, 2)) : NF4_EDATA;
    case OP_BININT:
        return (q = arg(m, 4)) ? push_kind(m, V_INT, (int32_t)(uint32_t)le_uint(q, 4)) : NF4_EDATA;
    case OP_LONG1:
        return op_long1(m);
    case OP_SHORT_BINUNICODE:
        return op_binunicode(m, 1);
    case OP_BINUNICODE:
        return op_binunicode(m, 4);
    case OP_BINUNICODE8:
        return op_binunicode(m, 8);
    case OP_GLOBAL:
        return op_global(m);
    case OP_STACK_GLOBAL:
        return op_stack_global(m);
    case OP_BINPUT:
        return (q = arg(m, 1)) ? memo_put(m, *q) : NF4_EDATA;
    case OP_LONG_BINPUT:
        return (q = arg(m, 4)) ? memo_put(m, le_uint(q, 4)) : NF4_EDATA;
    case OP_MEMOIZE:
        return memo_put(m, m->nmemo);
    case OP_BINGET:
        return (q = arg(m, 1)) ? memo_get(m, *q) : NF4_EDATA;
    case OP_LONG_BINGET:
        return (q = arg(m, 4)) ? memo_get(m, le_uint(q, 4)) : NF4_EDATA;
    case OP_REDUCE:
        return op_reduce(m);
    case OP_BINPERSID:
        return op_binpersid(m);
    case OP_BUILD:
        return op_build(m);
    default:
        return bad(m, "not an opcode torch.save writes for a dict of tensors");
    }
}

void torch_records_free(struct torch_tensor_record *r, size_t count)
{
    for (size_t k = 0; r && k < count; k++) {
        free(r[k].name);
        free(r[k].shape);
        free(r[k].storage);
    }
    free(r);
}

static int cmp_key_name(const void *a, const void *b)
{
    return strcmp((*(const struct value *const *)a)->s, (*(const struct value *const *)b)->s);
}

/* The dict STOP returned must map names, each once, to tensors. All of it is
 * checked on the machine's own values before anything is copied out: a
 * pickle can name one tensor or one long string under many keys through the
 * memo at four bytes a time, and copies made first would grow with the
 * square of its size. */
static int check_dict(struct machine *m, const struct value *d)
{
    if (d->kind != V_DICT)
        return nf4_fail(NF4_EDATA, m->path, NULL, "the pickle holds a %s, not a dict of tensors", kind_name(d->kind));
    size_t n = d->n / 2;
    for (size_t k = 0; k < n; k++) {
        const struct value *key = d->items[2 * k], *t = d->items[2 * k + 1];
        if (key->kind != V_STR)
            return nf4_fail(NF4_EDATA, m->path, NULL, "the dict has a %s key, not a tensor name",
                            kind_name(key->kind));
        if (t->kind != V_TENSOR)
            return nf4_fail(NF4_EDATA, m->path, key->s, "holds a %s, not a tensor: not a state dict of tensors",
                            kind_name(t->kind));
        uint64_t end;
        if (!checked_add_u64(t->u, (uint64_t)t->i, &end) || end > t->items[0]->u)
            return nf4_fail(NF4_EDATA, m->path, key->s, "%" PRIu64 " elements from element %" PRIu64
                            " run past the %" PRIu64 " of its storage", (uint64_t)t->i, t->u, t->items[0]->u);
        /* Each record copies its shape: within the budget rebuild_tensor keeps. */
        m->dims += t->ndim;
        if (m->dims > m->len)
            return bad(m, "more tensor dimensions than the pickle has bytes");
    }
    const struct value **keys = malloc((n ? n : 1) * sizeof *keys);
    if (!keys)
        return oom(m);
    for (size_t k = 0; k < n; k++)
        keys[k] = d->items[2 * k];
    qsort(keys, n, sizeof *keys, cmp_key_name);
    int code = NF4_OK;
    for (size_t k = 1; k < n && code == NF4_OK; k++)
        if (strcmp(keys[k - 1]->s, keys[k]->s) == 0)
            code = nf4_fail(NF4_EDATA, m->path, keys[k]->s, "tensor name appears twice in the dict");
    free(keys);
    return code;
}

static int take_records(struct machine *m, const struct value *d, struct torch_tensor_record **out, size_t *count)
{
    int code = check_dict(m, d);
    if (code != NF4_OK)
        return code;
    size_t n = d->n / 2;
    struct torch_tensor_record *r = calloc(n ? n : 1, sizeof *r);
    if (!r)
        return oom(m);
    for (size_t k = 0; k < n && code == NF4_OK; k++) {
        const struct value *key = d->items[2 * k], *t = d->items[2 * k + 1];
        r[k].name = strdup(key->s);
        r[k].storage = strdup(t->items[0]->s);
        r[k].shape = malloc((t->ndim ? t->ndim : 1) * sizeof *r[k].shape);
        if (!r[k].name || !r[k].storage || !r[k].shape) {
            code = oom(m);
            break;
        }
        memcpy(r[k].shape, t->shape, t->ndim * sizeof *r[k].shape);
        r[k].ndim = t->ndim;
        r[k].nelem = (uint64_t)t->i;
        r[k].dtype = t->dtype;
        r[k].storage_elems = t->items[0]->u;
        r[k].offset = t->u;
    }
    if (code != NF4_OK) {
        torch_records_free(r, n);
        return code;
    }
    *out = r;
    *count = n;
    return NF4_OK;
}

int torch_pickle_read(const char *path, const unsigned char *pkl, size_t len, struct torch_tensor_record **out,
                      size_t *count)
{
    *out = NULL;
    *count = 0;
    if (len > TORCH_MAX_PICKLE_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "pickle of %zu bytes is over the %u nf4deq reads", len,
                        TORCH_MAX_PICKLE_BYTES);
    struct machine m = {.path = path, .p = pkl, .len = len};
    int code = NF4_OK, stopped = 0;
    while (code == NF4_OK && !stopped) {
        if (m.at == m.len) {
            code = nf4_fail(NF4_EDATA, path, NULL, "pickle ends without STOP");
        } else if (m.p[m.at] == OP_STOP) {
            m.op_at = m.at++;
            stopped = 1;
        } else {
            code = step(&m);
        }
    }
    if (code == NF4_OK && m.at != m.len)
        code = nf4_fail(NF4_EDATA, path, NULL, "%zu bytes after the pickle's STOP", m.len - m.at);
    if (code == NF4_OK && (m.nmarks || m.sp != 1))
        code = bad(&m, "the stack does not hold one object");
    if (code == NF4_OK)
        code = take_records(&m, m.stack[0], out, count);
    for (size_t k = 0; k < m.nall; k++) {
        if (m.all[k]->kind != V_STORAGE) /* a storage's key is its string's */
            free(m.all[k]->s);
        free(m.all[k]->items);
        free(m.all[k]->shape);
        free(m.all[k]);
    }
    free(m.all);
    free(m.stack);
    free(m.marks);
    free(m.memo);
    return code;
}
