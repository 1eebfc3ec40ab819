#include "dtype.h"

#include <string.h>
#include <strings.h>

static const struct {
    const char *name;
    unsigned bits;
    const char *torch_name;
    int castable;
} DTYPES[DT_COUNT] = {
    [DT_BOOL] = {"BOOL", 8, NULL, 0},
    [DT_F4] = {"F4", 4, NULL, 0},
    [DT_F6_E2M3] = {"F6_E2M3", 6, NULL, 0},
    [DT_F6_E3M2] = {"F6_E3M2", 6, NULL, 0},
    [DT_U8] = {"U8", 8, NULL, 0},
    [DT_I8] = {"I8", 8, NULL, 0},
    [DT_F8_E5M2] = {"F8_E5M2", 8, NULL, 0},
    [DT_F8_E4M3] = {"F8_E4M3", 8, NULL, 0},
    [DT_F8_E8M0] = {"F8_E8M0", 8, NULL, 0},
    [DT_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8, NULL, 0},
    [DT_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8, NULL, 0},
    [DT_I16] = {"I16", 16, NULL, 0},
    [DT_U16] = {"U16", 16, NULL, 0},
    [DT_F16] = {"F16", 16, "float16", 1},
    [DT_BF16] = {"BF16", 16, "bfloat16", 1},
    [DT_I32] = {"I32", 32, NULL, 0},
    [DT_U32] = {"U32", 32, NULL, 0},
    [DT_F32] = {"F32", 32, "float32", 1},
    [DT_C64] = {"C64", 64, NULL, 0},
    [DT_F64] = {"F64", 64, "float64", 1},
    [DT_I64] = {"I64", 64, NULL, 0},
    [DT_U64] = {"U64", 64, NULL, 0},
};

enum st_dtype dtype_from_name(const char *name)
{
    for (int i = 0; i < DT_COUNT; i++)
        if (strcmp(DTYPES[i].name, name) == 0)
            return (enum st_dtype)i;
    return DT_INVALID;
}

const char *dtype_name(enum st_dtype dt)
{
    return (dt >= 0 && dt < DT_COUNT) ? DTYPES[dt].name : "?";
}

unsigned dtype_bits(enum st_dtype dt)
{
    return (dt >= 0 && dt < DT_COUNT) ? DTYPES[dt].bits : 0;
}

const char *dtype_torch_name(enum st_dtype dt)
{
    return (dt >= 0 && dt < DT_COUNT) ? DTYPES[dt].torch_name : NULL;
}

enum st_dtype dtype_from_torch_name(const char *name)
{
    if (strcmp(name, "float16") == 0)
        return DT_F16;
    if (strcmp(name, "bfloat16") == 0)
        return DT_BF16;
    if (strcmp(name, "float32") == 0)
        return DT_F32;
    return DT_INVALID;
}

enum st_dtype dtype_from_cli_name(const char *name)
{
    static const struct {
        const char *name;
        enum st_dtype dt;
    } NAMES[] = {
        {"fp16", DT_F16}, {"f16", DT_F16},   {"float16", DT_F16},  {"bf16", DT_BF16},
        {"bfloat16", DT_BF16}, {"fp32", DT_F32}, {"f32", DT_F32}, {"float32", DT_F32},
    };
    /* In any case: BF16 is how safetensors and inspect spell it. */
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (strcasecmp(NAMES[i].name, name) == 0)
            return NAMES[i].dt;
    return DT_INVALID;
}

int dtype_is_castable_float(enum st_dtype dt)
{
    return dt >= 0 && dt < DT_COUNT && DTYPES[dt].castable;
}
