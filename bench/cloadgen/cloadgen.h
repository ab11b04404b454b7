/*
 * What the modes of cloadgen share (bench/cloadgen/cloadgen.c: idle, sink, the helpers and main; sub.c: the
 * subscribers of the message rows; pub.c: the acknowledged rows' publishers). docs/benchmarks.md, "The C load
 * generator".
 */
#ifndef CLOADGEN_H
#define CLOADGEN_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#define LOOPBACK "127.0.0.1"
#define MAX_EVENTS 256

/* set by SIGTERM/SIGINT: every loop ends and reports */
extern volatile sig_atomic_t stop_requested;

/* CLOCK_MONOTONIC, seconds */
double now_s(void);
/* CLOCK_REALTIME, nanoseconds (Python's time.time_ns(): the clock of the payloads' send times and the reports) */
int64_t realtime_ns(void);
/* every byte of `len` on a non-blocking socket, waiting (poll) for room in its send buffer: a broker reads all the
 * time, so this waits for it, not for ever; 0, or -1 when the connection failed */
int send_fully(int fd, const uint8_t *p, size_t len);
/* this process's user + system CPU (getrusage), seconds */
double cpu_s(void);
/* a system error: says `what` and errno on stderr, exit status 1 */
void die(const char *what);
/* a usage error: says `msg` and the usage on stderr, exit status 2 */
void usage(const char *msg);
/* the soft RLIMIT_NOFILE raised towards `want` (at most the hard limit); the soft limit now in force */
long raise_nofile(long want, int warn);
/* pins the process to core `cpu` (< 0: left alone) */
void pin_cpu(int cpu);
/* a --host value: 0 when it is LOOPBACK, else says why on stderr and returns 2 (the benchmarks' hard rule:
 * traffic goes to loopback only) */
int check_host(const char *host);
/* option values; a bad one is a usage error */
long parse_long(const char *s, const char *name, long lo, long hi);
double parse_seconds(const char *s, const char *name);
/* the options the client modes (sub, pub) share: --host (a refused one returns -1), --port, --username,
 * --client-id-prefix (printed into the JSON reports as it is: at most 200 of [A-Za-z0-9-_./:]), --keep-alive,
 * --timeout and --cpu; 1 when `a` was one of them (its value `v` stored), 0 when not */
int client_option(const char *a, const char *v, int *port, const char **username, const char **prefix,
                  int *keep_alive, double *timeout, int *cpu);
/* close with SO_LINGER 0: a reset, no TIME_WAIT left behind */
void reset_close(int fd);
/* CONNECT, MQTT 3.1.1 §3.1 (Clean Session 1, user name when not NULL) into `out` (600 bytes suffice for a
 * client identifier of 300 and a user name of 256); its length */
size_t encode_connect(uint8_t *out, const char *client_id, const char *username, int keep_alive);

/* cloadgen sub (sub.c): argv after the mode */
int run_sub(int argc, char **argv);
/* cloadgen pub (pub.c): argv after the mode */
int run_pub(int argc, char **argv);

#endif
