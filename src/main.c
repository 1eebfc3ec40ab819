/* nf4deq: dequantize bitsandbytes 4-bit safetensors checkpoints. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "exit_handoff.h"
#include "fileio.h"
#include "status.h"

int main(int argc, char **argv)
{
    guard_std_streams();
    install_signal_cleanup();
    handoff_expect();
    int code = cli_main(argc, argv);
    cleanup_temps();
    /* A full disk or a closed pipe on stdout must not pass for success. */
    if (fflush(stdout) != 0 || ferror(stdout) || fclose(stdout) != 0) {
        if (code == 0) {
            fprintf(stderr, "nf4deq: write error on standard output: %s\n",
                    std_stream_was_closed(STDOUT_FILENO) ? "it is closed" : strerror(errno));
            code = 74;
        }
    }
    /* The output is complete and renamed: a child pays the CUDA driver's
     * teardown, not whoever waits for this process (exit_handoff.h). */
    if (handoff_wanted() && handoff_device_files(HANDOFF_DEVICE_PREFIX))
        _exit(code);
    return code;
}
