/*
 * cloadgen: the load generator of the benchmarks in C where bench/loadgen.py's Python one was the bound
 * (docs/benchmarks.md, "The C load generator"): the idle-connection opener and its sink here, the message rows'
 * subscribers in sub.c, the acknowledged rows' publishers in pub.c.
 *
 * bench/loadgen.py's run_idle opens connections from Python, and on the benchmark machine that, not the broker, was
 * the limit of Mosquitto's connect rate. This program does the same work with non-blocking sockets and epoll, the
 * MQTT 3.1.1 CONNECT and CONNACK encoded by hand, and nothing but libc.
 *
 *   cloadgen idle --port P [--connections N] [--concurrency C] [--keep-alive S] [--username U]
 *                 [--client-id-prefix X] [--timeout S] [--hold S] [--cpu K] [--host 127.0.0.1]
 *       Opens N connections to 127.0.0.1:P with at most C handshakes in flight (connect started or CONNECT sent,
 *       CONNACK not yet read). Each sends CONNECT (3.1.1, Clean Session 1, Keep Alive S, Client Identifier
 *       X<i>, user name U when given); a connection counts as connected when its CONNACK is 20 02 00 00 (Session
 *       Present 0, return code 0x00 Connection Accepted), otherwise as failed. When every connection is answered
 *       (or --timeout seconds passed: the unanswered ones count as failed) it prints one JSON line:
 *         {"connected": n, "failed": n, "elapsed": s, "cpu_s": s, ...}
 *       elapsed is from the first connect to the last CONNACK, cpu_s this process's user + system CPU over the
 *       same span (getrusage), the keys of bench/loadgen.py's run_idle report. It then holds the connections open
 *       and idle (no PINGREQ) until stdin is closed, or for --hold seconds when given (stdin is then not read), or
 *       until SIGTERM/SIGINT; resets them all (SO_LINGER 0: no TIME_WAIT left behind) and prints
 *         {"closed": n, "dropped": n}
 *       where dropped counts the connections the broker closed while they were held.
 *
 *   cloadgen sink [--hold S] [--cpu K]
 *       A do-nothing MQTT server on 127.0.0.1 (a port the kernel picks), for measuring the generator's own
 *       ceiling: prints {"port": P}, answers every CONNECT with 20 02 00 00 and every PINGREQ with PINGRESP,
 *       discards everything else, and on stdin's end (or after --hold seconds) prints
 *         {"connections": n, "connacks": n}.
 *
 *   cloadgen sub ...
 *       The subscribers of the message rows (fan-out, retained, QoS 1 and QoS 2 end to end): sub.c says what they
 *       do and check.
 *
 *   cloadgen pub ...
 *       The publishers of the QoS 1 and QoS 2 end-to-end rows: pub.c says what they do and report.
 *
 * Loopback only: --host accepts 127.0.0.1 and nothing else, and the sink binds 127.0.0.1. RLIMIT_NOFILE's soft
 * limit is raised as far as the connections need (up to the hard limit); when the hard limit is too low it says
 * so on stderr and the connections past it count as failed.
 *
 * Exit status: 0 when it ran (whatever it counted), 2 on a usage error or a refused host, 1 on a system error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cloadgen.h"

volatile sig_atomic_t stop_requested;

static void on_signal(int sig) {
    (void)sig;
    stop_requested = 1;
}

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int client_option(const char *a, const char *v, int *port, const char **username, const char **prefix,
                  int *keep_alive, double *timeout, int *cpu) {
    static const char id_chars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:";
    if (strcmp(a, "--host") == 0) {
        if (check_host(v) != 0) return -1;
    } else if (strcmp(a, "--port") == 0) {
        *port = (int)parse_long(v, "port", 1, 65535);
    } else if (strcmp(a, "--username") == 0) {
        if (strlen(v) > 256) usage("user name longer than 256 bytes");
        *username = v;
    } else if (strcmp(a, "--client-id-prefix") == 0) {
        if (strlen(v) > 200 || strspn(v, id_chars) != strlen(v))
            usage("client id prefix: at most 200 of [A-Za-z0-9-_./:]");
        *prefix = v;
    } else if (strcmp(a, "--keep-alive") == 0) {
        *keep_alive = (int)parse_long(v, "keep alive", 0, 65535);
    } else if (strcmp(a, "--timeout") == 0) {
        *timeout = parse_seconds(v, "timeout");
    } else if (strcmp(a, "--cpu") == 0) {
        *cpu = (int)parse_long(v, "cpu", 0, CPU_SETSIZE - 1);
    } else {
        return 0;
    }
    return 1;
}

int64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int send_fully(int fd, const uint8_t *p, size_t len) {
    while (len) {
        ssize_t w = send(fd, p, len, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            len -= (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            if (poll(&pf, 1, 1000) < 0 && errno != EINTR) return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

/* How long a holding loop may wait in epoll_wait (ms, at most 1 s so a signal's flag is seen): until `until` when
 * --hold was given (hold >= 0), else 1 s; -1 once `until` has passed. */
static int hold_wait_ms(double hold, double until) {
    if (hold < 0) return 1000;
    double left = until - now_s();
    if (left <= 0) return -1;
    int ms = (int)(left * 1000) + 1;
    return ms > 1000 ? 1000 : ms;
}

double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec / 1e6;
}

void die(const char *what) {
    fprintf(stderr, "cloadgen: %s: %s\n", what, strerror(errno));
    exit(1);
}

void usage(const char *msg) {
    fprintf(stderr,
            "cloadgen: %s\n"
            "usage: cloadgen idle --port P [--connections N] [--concurrency C] [--keep-alive S] [--username U]\n"
            "                     [--client-id-prefix X] [--timeout S] [--hold S] [--cpu K] [--host 127.0.0.1]\n"
            "       cloadgen sink [--hold S] [--cpu K]\n"
            "       cloadgen sub --port P --subscribers N --topic-filter F [--qos Q] [--pubs K] [--per-pub M]\n"
            "                    [--expect N] [--retained] [--at-once] [--latency] [--bitmaps] [--username U]\n"
            "                    [--client-id-prefix X] [--keep-alive S] [--timeout S] [--idle S]\n"
            "                    [--coalesce-us U] [--max-seq N] [--cpu K] [--host 127.0.0.1]\n"
            "       cloadgen pub --port P --publishers N --topic-prefix T [--qos 1|2] [--window W] [--duration S]\n"
            "                    [--count M] [--username U] [--client-id-prefix X] [--keep-alive S] [--timeout S]\n"
            "                    [--cpu K] [--host 127.0.0.1]\n",
            msg);
    exit(2);
}

/* The soft RLIMIT_NOFILE raised to `want` (at most the hard limit); returns the soft limit now in force. With
 * `warn`, says on stderr when it stays below `want`. */
long raise_nofile(long want, int warn) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) die("getrlimit");
    rlim_t target = (rl.rlim_max != RLIM_INFINITY && (rlim_t)want > rl.rlim_max) ? rl.rlim_max : (rlim_t)want;
    if (rl.rlim_cur < target) {
        rl.rlim_cur = target;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0 && warn)
            fprintf(stderr, "cloadgen: cannot raise RLIMIT_NOFILE to %ld: %s\n", (long)target, strerror(errno));
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (warn && rl.rlim_cur < (rlim_t)want)
        fprintf(stderr,
                "cloadgen: RLIMIT_NOFILE is %ld (hard limit %ld), below the %ld descriptors wanted: the "
                "connections past it will fail\n",
                (long)rl.rlim_cur, rl.rlim_max == RLIM_INFINITY ? -1L : (long)rl.rlim_max, want);
    return (long)rl.rlim_cur;
}

void pin_cpu(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) die("sched_setaffinity");
}

int check_host(const char *host) {
    if (strcmp(host, LOOPBACK) == 0) return 0;
    fprintf(stderr, "cloadgen: refusing host %s: only %s (loopback) is allowed\n", host, LOOPBACK);
    return 2;
}

long parse_long(const char *s, const char *name, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) {
        char msg[128];
        snprintf(msg, sizeof msg, "bad %s: %s", name, s);
        usage(msg);
    }
    return v;
}

double parse_seconds(const char *s, const char *name) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= 0)) {
        char msg[128];
        snprintf(msg, sizeof msg, "bad %s: %s", name, s);
        usage(msg);
    }
    return v;
}

void reset_close(int fd) {
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
}

/* ------------------------------------------------------------------------------------------------------------ */
/* idle */

enum { S_FREE, S_CONNECTING, S_SENT, S_HELD, S_DONE };

struct conn {
    int fd;
    uint8_t state;
    uint8_t got;
    uint8_t buf[4];
};

struct idle_opts {
    int port;
    long n;
    long concurrency;
    int keep_alive;
    const char *username;
    const char *prefix;
    double timeout;
    double hold; /* < 0: until stdin closes */
};

/* CONNECT, MQTT 3.1.1 §3.1: protocol name "MQTT", level 4, flags Clean Session (+ User Name), Keep Alive,
 * then the Client Identifier and the user name, each a two-byte length and its bytes. */
size_t encode_connect(uint8_t *out, const char *client_id, const char *username, int keep_alive) {
    size_t idlen = strlen(client_id), ulen = username ? strlen(username) : 0;
    size_t remaining = 10 + 2 + idlen + (username ? 2 + ulen : 0);
    size_t i = 0;
    out[i++] = 0x10;
    do {
        uint8_t b = remaining & 0x7f;
        remaining >>= 7;
        out[i++] = remaining ? (uint8_t)(b | 0x80) : b;
    } while (remaining);
    static const uint8_t proto[] = {0x00, 0x04, 'M', 'Q', 'T', 'T', 0x04};
    memcpy(out + i, proto, sizeof proto);
    i += sizeof proto;
    out[i++] = (uint8_t)(0x02 | (username ? 0x80 : 0));
    out[i++] = (uint8_t)(keep_alive >> 8);
    out[i++] = (uint8_t)keep_alive;
    out[i++] = (uint8_t)(idlen >> 8);
    out[i++] = (uint8_t)idlen;
    memcpy(out + i, client_id, idlen);
    i += idlen;
    if (username) {
        out[i++] = (uint8_t)(ulen >> 8);
        out[i++] = (uint8_t)ulen;
        memcpy(out + i, username, ulen);
        i += ulen;
    }
    return i;
}

/* 0 when the CONNECT went out whole (a fresh socket's send buffer takes its ~40 bytes at once), else -1 with errno
 * (EAGAIN: the handshake is not complete yet). */
static int send_connect(struct conn *c, long index, const struct idle_opts *o) {
    uint8_t pkt[600];
    char id[300];
    snprintf(id, sizeof id, "%s%ld", o->prefix, index);
    size_t len = encode_connect(pkt, id, o->username, o->keep_alive);
    ssize_t w = send(c->fd, pkt, len, MSG_NOSIGNAL);
    if (w >= 0 && w != (ssize_t)len) errno = EIO;
    return w == (ssize_t)len ? 0 : -1;
}

static int run_idle(const struct idle_opts *o) {
    long nofile = raise_nofile(o->n + 64, 1);
    struct conn *conns = calloc((size_t)o->n, sizeof *conns);
    if (!conns) die("calloc");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    inet_pton(AF_INET, LOOPBACK, &addr.sin_addr);

    long started = 0, pending = 0, connected = 0, failed = 0;
    int first_errno = 0;
    struct epoll_event evs[MAX_EVENTS];
    double cpu0 = cpu_s();
    double t0 = now_s(), t_last = t0, deadline = t0 + o->timeout;

#define FAIL(c, err)                                   \
    do {                                               \
        if (!first_errno) first_errno = (err);         \
        if ((c)->fd >= 0) close((c)->fd);              \
        (c)->fd = -1;                                  \
        (c)->state = S_DONE;                           \
        failed++;                                      \
    } while (0)

    while (connected + failed < o->n && !stop_requested) {
        double t = now_s();
        if (t >= deadline) break;
        while (started < o->n && pending < o->concurrency) {
            struct conn *c = &conns[started];
            long i = started++;
            c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (c->fd < 0) {
                FAIL(c, errno);
                continue;
            }
            /* One-shot registrations: a connection answered needs no epoll_ctl to leave the set (the hold phase
             * re-arms it), which keeps the measured part to socket, connect, send, one epoll_ctl and recv. */
            struct epoll_event ev = {.data.u64 = (uint64_t)i};
            if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) != 0 && errno != EINPROGRESS) {
                FAIL(c, errno);
                continue;
            }
            /* On loopback the handshake has usually completed by the time connect() returns EINPROGRESS: send at
             * once, and wait for writability only when the socket is still in SYN-SENT. */
            if (send_connect(c, i, o) == 0) {
                c->state = S_SENT;
                ev.events = EPOLLIN | EPOLLONESHOT;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOTCONN) {
                c->state = S_CONNECTING;
                ev.events = EPOLLOUT | EPOLLONESHOT;
            } else {
                FAIL(c, errno);
                continue;
            }
            if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) != 0) die("epoll_ctl");
            pending++;
        }
        int wait_ms = (int)((deadline - t) * 1000) + 1;
        int nev = epoll_wait(ep, evs, MAX_EVENTS, wait_ms < 100 ? wait_ms : 100);
        if (nev < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int k = 0; k < nev; k++) {
            long i = (long)evs[k].data.u64;
            struct conn *c = &conns[i];
            if (c->state == S_CONNECTING) {
                int err = 0;
                socklen_t len = sizeof err;
                getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
                if (err || send_connect(c, i, o) != 0) {
                    pending--;
                    FAIL(c, err ? err : (errno ? errno : EIO));
                    continue;
                }
                c->state = S_SENT;
                struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.u64 = (uint64_t)i};
                if (epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev) != 0) die("epoll_ctl");
                continue;
            }
            if (c->state != S_SENT) continue;
            ssize_t r = recv(c->fd, c->buf + c->got, (size_t)(4 - c->got), 0);
            if (r > 0) c->got = (uint8_t)(c->got + r);
            if ((r < 0 && (errno == EAGAIN || errno == EINTR)) || (r > 0 && c->got < 4)) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.u64 = (uint64_t)i};
                if (epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev) != 0) die("epoll_ctl");
                continue;
            }
            if (r <= 0) {
                pending--;
                FAIL(c, r < 0 ? errno : ECONNRESET);
                continue;
            }
            pending--;
            t_last = now_s();
            /* CONNACK (§3.2): Session Present 0 (Clean Session 1, [MQTT-3.2.2-1]), return code 0x00 */
            if (c->buf[0] == 0x20 && c->buf[1] == 0x02 && c->buf[2] == 0x00 && c->buf[3] == 0x00) {
                c->state = S_HELD;
                connected++;
            } else {
                FAIL(c, EPROTO);
            }
        }
    }
    double cpu1 = cpu_s();
    /* whatever is still unanswered at the deadline failed */
    long timed_out = 0;
    for (long i = 0; i < o->n; i++) {
        struct conn *c = &conns[i];
        if (c->state == S_CONNECTING || c->state == S_SENT) {
            FAIL(c, ETIMEDOUT); /* close() takes it out of the epoll set */
            timed_out++;
        } else if (c->state == S_FREE) {
            failed++;
            timed_out++;
        }
    }
    printf("{\"connected\": %ld, \"failed\": %ld, \"elapsed\": %.6f, \"cpu_s\": %.6f, \"timed_out\": %ld, "
           "\"nofile\": %ld, \"first_error\": \"%s\", \"generator\": \"cloadgen\"}\n",
           connected, failed, t_last - t0, cpu1 - cpu0, timed_out, nofile, first_errno ? strerror(first_errno) : "");
    fflush(stdout);
    if (failed && first_errno)
        fprintf(stderr, "cloadgen: %ld of %ld connections failed (first: %s)\n", failed, o->n, strerror(first_errno));

    /* hold: watch the held connections for the broker closing them, and stdin for its end */
    long dropped = 0;
    for (long i = 0; i < o->n; i++) {
        if (conns[i].state != S_HELD) continue;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.u64 = (uint64_t)i}; /* re-armed */
        if (epoll_ctl(ep, EPOLL_CTL_MOD, conns[i].fd, &ev) != 0) die("epoll_ctl");
    }
    int watch_stdin = o->hold < 0;
    if (watch_stdin) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLHUP, .data.u64 = UINT64_MAX};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, STDIN_FILENO, &ev) != 0)
            watch_stdin = 0; /* not a pipe or terminal (a file, /dev/null): its end is now */
    }
    double until = o->hold >= 0 ? now_s() + o->hold : 0;
    int released = !watch_stdin && o->hold < 0;
    while (!released && !stop_requested) {
        int wait_ms = hold_wait_ms(o->hold, until);
        if (wait_ms < 0) break;
        int nev = epoll_wait(ep, evs, MAX_EVENTS, wait_ms);
        if (nev < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int k = 0; k < nev; k++) {
            if (evs[k].data.u64 == UINT64_MAX) {
                char b[512];
                ssize_t r = read(STDIN_FILENO, b, sizeof b);
                if (r <= 0 && !(r < 0 && (errno == EINTR || errno == EAGAIN))) released = 1;
                continue;
            }
            struct conn *c = &conns[evs[k].data.u64];
            char b[512];
            ssize_t r = recv(c->fd, b, sizeof b, 0);
            if (r > 0 || (r < 0 && (errno == EAGAIN || errno == EINTR))) continue; /* nothing is expected: drop it */
            close(c->fd);
            c->fd = -1;
            c->state = S_DONE;
            dropped++;
        }
    }
    long closed = 0;
    for (long i = 0; i < o->n; i++) {
        if (conns[i].state == S_HELD) {
            reset_close(conns[i].fd);
            closed++;
        }
    }
    printf("{\"closed\": %ld, \"dropped\": %ld}\n", closed, dropped);
    fflush(stdout);
    close(ep);
    free(conns);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* sink */

struct sconn {
    uint32_t len;  /* bytes in buf */
    uint32_t skip; /* bytes still to discard of a packet larger than buf */
    uint8_t buf[256];
};

static int run_sink(double hold) {
    long nofile = raise_nofile(65536, 0); /* as many as the hard limit allows */
    struct sconn **conns = calloc((size_t)nofile, sizeof *conns);
    if (!conns) die("calloc");
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (ls < 0) die("socket");
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
    inet_pton(AF_INET, LOOPBACK, &addr.sin_addr);
    if (bind(ls, (struct sockaddr *)&addr, sizeof addr) != 0) die("bind");
    if (listen(ls, 4096) != 0) die("listen");
    socklen_t alen = sizeof addr;
    getsockname(ls, (struct sockaddr *)&addr, &alen);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev) != 0) die("epoll_ctl");
    int watch_stdin = hold < 0;
    if (watch_stdin) {
        ev.events = EPOLLIN | EPOLLHUP;
        ev.data.fd = STDIN_FILENO;
        if (epoll_ctl(ep, EPOLL_CTL_ADD, STDIN_FILENO, &ev) != 0) watch_stdin = 0;
    }
    printf("{\"port\": %d}\n", ntohs(addr.sin_port));
    fflush(stdout);
    long connections = 0, connacks = 0;
    double until = hold >= 0 ? now_s() + hold : 0;
    int released = !watch_stdin && hold < 0;
    struct epoll_event evs[MAX_EVENTS];
    static const uint8_t connack[4] = {0x20, 0x02, 0x00, 0x00};
    static const uint8_t pingresp[2] = {0xd0, 0x00};
    while (!released && !stop_requested) {
        int wait_ms = hold_wait_ms(hold, until);
        if (wait_ms < 0) break;
        int nev = epoll_wait(ep, evs, MAX_EVENTS, wait_ms);
        if (nev < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int k = 0; k < nev; k++) {
            int fd = evs[k].data.fd;
            if (fd == STDIN_FILENO) {
                char b[512];
                ssize_t r = read(STDIN_FILENO, b, sizeof b);
                if (r <= 0 && !(r < 0 && (errno == EINTR || errno == EAGAIN))) released = 1;
                continue;
            }
            if (fd == ls) {
                for (;;) {
                    int s = accept4(ls, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (s < 0) break;
                    if (s >= nofile || !(conns[s] = calloc(1, sizeof **conns))) {
                        close(s);
                        continue;
                    }
                    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct epoll_event cev = {.events = EPOLLIN, .data.fd = s};
                    epoll_ctl(ep, EPOLL_CTL_ADD, s, &cev);
                    connections++;
                }
                continue;
            }
            struct sconn *c = conns[fd];
            ssize_t r = recv(fd, c->buf + c->len, sizeof c->buf - c->len, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            int closing = r <= 0;
            if (!closing) {
                uint32_t end = c->len + (uint32_t)r, pos = 0;
                if (c->skip) {
                    uint32_t d = c->skip < end ? c->skip : end;
                    c->skip -= d;
                    pos = d;
                }
                while (!c->skip && pos + 2 <= end) {
                    uint32_t len = 0, shift = 0, hdr = 1;
                    int complete = 0;
                    while (pos + hdr < end && hdr <= 4) {
                        uint8_t b = c->buf[pos + hdr++];
                        len |= (uint32_t)(b & 0x7f) << shift;
                        shift += 7;
                        if (!(b & 0x80)) {
                            complete = 1;
                            break;
                        }
                    }
                    if (!complete) break;
                    uint8_t kind = c->buf[pos] >> 4;
                    if (kind == 1) {
                        if (send(fd, connack, sizeof connack, MSG_NOSIGNAL) == (ssize_t)sizeof connack) connacks++;
                    } else if (kind == 12) {
                        send(fd, pingresp, sizeof pingresp, MSG_NOSIGNAL);
                    } else if (kind == 14) {
                        closing = 1;
                        break;
                    }
                    if (pos + hdr + len > end) { /* the rest of this packet is still to come: discard it */
                        c->skip = pos + hdr + len - end;
                        pos = end;
                        break;
                    }
                    pos += hdr + len;
                }
                c->len = end - pos;
                memmove(c->buf, c->buf + pos, c->len);
            }
            if (closing) {
                epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
                close(fd);
                free(c);
                conns[fd] = NULL;
            }
        }
    }
    for (long fd = 0; fd < nofile; fd++) {
        if (conns[fd]) {
            reset_close((int)fd);
            free(conns[fd]);
        }
    }
    close(ls);
    close(ep);
    free(conns);
    printf("{\"connections\": %ld, \"connacks\": %ld}\n", connections, connacks);
    fflush(stdout);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    if (argc < 2) usage("a mode is needed: idle, sink, sub or pub");
    const char *mode = argv[1];
    int is_idle = strcmp(mode, "idle") == 0, is_sink = strcmp(mode, "sink") == 0;
    if (strcmp(mode, "sub") == 0 || strcmp(mode, "pub") == 0) {
        struct sigaction sa = {.sa_handler = on_signal};
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        signal(SIGPIPE, SIG_IGN);
        return mode[0] == 's' ? run_sub(argc - 2, argv + 2) : run_pub(argc - 2, argv + 2);
    }
    if (!is_idle && !is_sink) usage("the mode is idle, sink, sub or pub");
    struct idle_opts o = {.port = 0, .n = 5000, .concurrency = 64, .keep_alive = 60, .username = NULL,
                          .prefix = NULL, .timeout = 60.0, .hold = -1};
    int cpu = -1;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "idle-c%ld-", (long)getpid());
    o.prefix = prefix;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) usage("every option takes a value");
        const char *v = argv[++i];
        if (strcmp(a, "--host") == 0) {
            if (check_host(v) != 0) return 2;
        } else if (strcmp(a, "--port") == 0) {
            o.port = (int)parse_long(v, "port", 1, 65535);
        } else if (strcmp(a, "--connections") == 0) {
            o.n = parse_long(v, "connections", 1, 10000000);
        } else if (strcmp(a, "--concurrency") == 0) {
            o.concurrency = parse_long(v, "concurrency", 1, 1000000);
        } else if (strcmp(a, "--keep-alive") == 0) {
            o.keep_alive = (int)parse_long(v, "keep alive", 0, 65535);
        } else if (strcmp(a, "--username") == 0) {
            if (strlen(v) > 256) usage("user name longer than 256 bytes");
            o.username = v;
        } else if (strcmp(a, "--client-id-prefix") == 0) {
            if (strlen(v) > 200) usage("client id prefix longer than 200 bytes");
            o.prefix = v;
        } else if (strcmp(a, "--timeout") == 0) {
            o.timeout = parse_seconds(v, "timeout");
        } else if (strcmp(a, "--hold") == 0) {
            o.hold = parse_seconds(v, "hold");
        } else if (strcmp(a, "--cpu") == 0) {
            cpu = (int)parse_long(v, "cpu", 0, CPU_SETSIZE - 1);
        } else {
            char msg[128];
            snprintf(msg, sizeof msg, "unknown option %s", a);
            usage(msg);
        }
    }
    if (is_idle && !o.port) usage("idle needs --port");
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    pin_cpu(cpu);
    return is_idle ? run_idle(&o) : run_sink(o.hold);
}
