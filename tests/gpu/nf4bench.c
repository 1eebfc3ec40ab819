/* Stand-alone `nf4deq bench` (build/gpu/nf4bench), for device runs of a tree
 * whose CLI is not built: `nf4bench [bench options]`. */
#include <stdio.h>

#include "bench.h"
#include "status.h"

int main(int argc, char **argv)
{
    char name[] = "bench";
    argv[0] = name;
    int rc = cmd_bench(argc, argv);
    if (rc)
        fprintf(stderr, "nf4deq: %s\n", nf4_last_error());
    return rc;
}
