/*
 * cloadgen pub: the publishers of the QoS 1 and QoS 2 end-to-end rows in C (docs/benchmarks.md, "The C load
 * generator").
 *
 * Those rows are bounded by their windows (4 publishers x 32 in flight, 32 in flight to the subscriber): a message
 * leaves a window only after round trips through the broker and a client, so the clients' own time per packet is
 * part of every round trip. bench/loadgen.py's run_publisher_qos1 spends several microseconds of Python per packet;
 * this mode does the same work on one thread with epoll and libc only.
 *
 *   cloadgen pub --port P --publishers N --topic-prefix T [--qos 1|2] [--window W] [--duration S]
 *                [--count M] [--username U] [--client-id-prefix X] [--keep-alive S] [--timeout S] [--cpu K]
 *                [--host 127.0.0.1]
 *
 *   Opens N connections to 127.0.0.1:P, Client Identifiers X<i>, CONNECT 3.1.1 with Clean Session 1, Keep Alive
 *   S (60) and user name U when given; once every CONNACK accepted it prints {"ready": N} and waits for the line
 *   "go" on stdin. Then publisher i publishes to the topic T<i> at QoS 1 (default) or 2 with at most W (32)
 *   messages unacknowledged, for S seconds (4) or until it sent M messages (--count: the offline row's fixed
 *   backlog), then waits for the outstanding acknowledgements, sends DISCONNECT and closes. A message is
 *   acknowledged at its PUBACK (QoS 1) or its PUBCOMP (QoS 2: a PUBREC is answered with PUBREL, MQTT 3.1.1
 *   §4.3.3). Its Packet Identifier is its sequence number mod 65535, plus 1 (never 0: W is
 *   below 65535, so no two in flight share one).
 *
 *   Each payload is 64 bytes: publisher id i (2 bytes, big endian), sequence number (4), CLOCK_REALTIME in ns
 *   when the write that carries it was built (8), padding: bench/loadgen.py's HEADER, what the subscribers check.
 *
 *   A publisher fails ("error") when the broker closes its connection, or when no acknowledgement came for 10 s
 *   while it waits for the last ones, or at --timeout (60 s) from the start. It prints one JSON line:
 *     {"cpu_s": s, "elapsed": s, "publishers": [{"pub": i, "sent": n, "acked": n, "acked_bitmap": "hex",
 *       "t_start_ns": ns, "t_end_ns": ns, "error": null|"..."}, ...], "generator": "cloadgen"}
 *   acked_bitmap has bit (s & 7) of byte s >> 3 set for each acknowledged sequence number s (hex, sent bits);
 *   t_start_ns is when "go" was read and t_end_ns when the publisher finished (CLOCK_REALTIME: time.time_ns());
 *   cpu_s is this process's user + system CPU from "go" to the end, elapsed the wall time of the same span:
 *   the keys of run_publisher_qos1's report, per publisher.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cloadgen.h"

#define PAYLOAD_SIZE 64
#define READ_BUF (64 * 1024)
#define ACK_SILENCE 10.0 /* seconds without an acknowledgement, while waiting for the last ones, that fail */
#define STDIN_KEY UINT64_MAX

struct pub {
    int fd;
    int done;
    long sent, acked;
    uint8_t *acked_bm; /* bit-packed, by sequence number */
    size_t acked_cap;  /* its size in bytes */
    uint32_t inflight[65536];  /* the sequence number of each Packet Identifier in flight */
    int64_t t_end_ns;
    double last_ack;
    const char *error;
    char error_buf[64];
    uint32_t carry_len;
    uint8_t carry[8];  /* the acknowledgements are 4 bytes: a cut one is carried over */
    uint8_t topic[300];
    size_t topic_len;
};

struct pub_opts {
    int port;
    long n;
    const char *prefix;
    const char *topic_prefix;
    const char *username;
    int qos;
    long window;
    double duration;
    long count;
    int keep_alive;
    double timeout;
};

/* one PUBLISH, MQTT 3.1.1 §3.3, into `out`: its length */
static size_t encode_publish(uint8_t *out, const struct pub *p, int qos, long pub, uint32_t seq, int64_t ts) {
    size_t remaining = 2 + p->topic_len + 2 + PAYLOAD_SIZE, i = 0;
    out[i++] = (uint8_t)(0x30 | (qos << 1));
    do {
        uint8_t b = remaining & 0x7f;
        remaining >>= 7;
        out[i++] = remaining ? (uint8_t)(b | 0x80) : b;
    } while (remaining);
    out[i++] = (uint8_t)(p->topic_len >> 8);
    out[i++] = (uint8_t)p->topic_len;
    memcpy(out + i, p->topic, p->topic_len);
    i += p->topic_len;
    uint16_t pid = (uint16_t)(seq % 65535 + 1);
    out[i++] = (uint8_t)(pid >> 8);
    out[i++] = (uint8_t)pid;
    out[i++] = (uint8_t)(pub >> 8);
    out[i++] = (uint8_t)pub;
    for (int k = 3; k >= 0; k--) out[i++] = (uint8_t)(seq >> (8 * k));
    for (int k = 7; k >= 0; k--) out[i++] = (uint8_t)((uint64_t)ts >> (8 * k));
    memset(out + i, '.', PAYLOAD_SIZE - 14);
    return i + PAYLOAD_SIZE - 14;
}

static uint8_t wbuf[256 * 1024];

/* fills publisher i's window; -1 when the write failed */
static int fill_window(const struct pub_opts *o, struct pub *p, long i) {
    long room = o->window - (p->sent - p->acked);
    if (o->count && room > o->count - p->sent) room = o->count - p->sent;
    if (room <= 0) return 0;
    if ((size_t)(p->sent + room + 7) / 8 >= p->acked_cap) {
        size_t cap = p->acked_cap * 2;
        while ((size_t)(p->sent + room + 7) / 8 >= cap) cap *= 2;
        uint8_t *m = realloc(p->acked_bm, cap);
        if (!m) die("realloc");
        memset(m + p->acked_cap, 0, cap - p->acked_cap);
        p->acked_bm = m;
        p->acked_cap = cap;
    }
    int64_t ts = realtime_ns();
    size_t len = 0;
    for (long k = 0; k < room; k++) {
        uint32_t seq = (uint32_t)p->sent++;
        p->inflight[seq % 65535 + 1] = seq;
        len += encode_publish(wbuf + len, p, o->qos, i, seq, ts);
    }
    return send_fully(p->fd, wbuf, len);
}

static void finish(struct pub *p, const char *error) {
    static const uint8_t disconnect[2] = {0xe0, 0x00};
    if (p->done) return;
    p->done = 1;
    p->error = error;
    p->t_end_ns = realtime_ns();
    if (!error) {
        send(p->fd, disconnect, sizeof disconnect, MSG_NOSIGNAL);
        shutdown(p->fd, SHUT_WR);
    }
    close(p->fd);
    p->fd = -1;
}

/* the acknowledgements in one read of publisher p; -1 when the connection failed or sent what a publisher does not
 * expect */
static int on_read(const struct pub_opts *o, struct pub *p, const uint8_t *data, size_t len, double now) {
    uint8_t buf[READ_BUF + 8];
    memcpy(buf, p->carry, p->carry_len);
    memcpy(buf + p->carry_len, data, len);
    len += p->carry_len;
    uint8_t rels[READ_BUF];
    size_t nrel = 0, pos = 0;
    for (; pos + 4 <= len; pos += 4) {
        uint8_t kind = buf[pos] >> 4;
        if (buf[pos + 1] != 0x02) return -1; /* every acknowledgement is 4 bytes (§3.4-§3.7) */
        uint16_t pid = (uint16_t)((buf[pos + 2] << 8) | buf[pos + 3]);
        if (kind == 5 && o->qos == 2) { /* PUBREC: PUBREL, §3.6 (fixed header flags 0010) */
            rels[nrel++] = 0x62;
            rels[nrel++] = 0x02;
            rels[nrel++] = (uint8_t)(pid >> 8);
            rels[nrel++] = (uint8_t)pid;
        } else if ((kind == 4 && o->qos == 1) || (kind == 7 && o->qos == 2)) { /* PUBACK, PUBCOMP */
            uint32_t seq = p->inflight[pid];
            uint8_t bit = (uint8_t)(1u << (seq & 7));
            if (!(p->acked_bm[seq >> 3] & bit)) {
                p->acked_bm[seq >> 3] |= bit;
                p->acked++;
                p->last_ack = now;
            }
        } else {
            return -1;
        }
    }
    p->carry_len = (uint32_t)(len - pos);
    memcpy(p->carry, buf + pos, p->carry_len);
    return nrel ? send_fully(p->fd, rels, nrel) : 0;
}

int run_pub(int argc, char **argv) {
    struct pub_opts o = {.port = 0, .n = 0, .prefix = NULL, .topic_prefix = NULL, .username = NULL, .qos = 1,
                         .window = 32, .duration = 4.0, .count = 0, .keep_alive = 60, .timeout = 60.0};
    int cpu = -1;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "pub-c%ld-", (long)getpid());
    o.prefix = prefix;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) usage("every option of pub takes a value");
        const char *v = argv[++i];
        int common = client_option(a, v, &o.port, &o.username, &o.prefix, &o.keep_alive, &o.timeout, &cpu);
        if (common < 0) return 2;
        if (common) continue;
        if (strcmp(a, "--publishers") == 0) {
            o.n = parse_long(v, "publishers", 1, 1000);
        } else if (strcmp(a, "--topic-prefix") == 0) {
            if (!*v || strlen(v) > 256) usage("the topic prefix is 1 to 256 bytes");
            o.topic_prefix = v;
        } else if (strcmp(a, "--qos") == 0) {
            o.qos = (int)parse_long(v, "qos", 1, 2);
        } else if (strcmp(a, "--window") == 0) {
            o.window = parse_long(v, "window", 1, 2048);
        } else if (strcmp(a, "--duration") == 0) {
            o.duration = parse_seconds(v, "duration");
        } else if (strcmp(a, "--count") == 0) {
            o.count = parse_long(v, "count", 1, 1L << 31);
        } else {
            char msg[128];
            snprintf(msg, sizeof msg, "unknown option %s", a);
            usage(msg);
        }
    }
    if (!o.port || !o.n || !o.topic_prefix) usage("pub needs --port, --publishers and --topic-prefix");
    pin_cpu(cpu);
    raise_nofile(o.n + 64, 1);
    double deadline = now_s() + o.timeout;

    struct pub *pubs = calloc((size_t)o.n, sizeof *pubs);
    if (!pubs) die("calloc");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o.port)};
    inet_pton(AF_INET, LOOPBACK, &addr.sin_addr);
    int one = 1;
    uint8_t pkt[600];
    /* connect: blocking, one publisher after the other (a handful of connections) */
    for (long i = 0; i < o.n; i++) {
        struct pub *p = &pubs[i];
        p->topic_len = (size_t)snprintf((char *)p->topic, sizeof p->topic, "%s%ld", o.topic_prefix, i);
        p->acked_cap = 1 << 16;
        p->acked_bm = calloc(p->acked_cap, 1);
        if (!p->acked_bm) die("calloc");
        p->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (p->fd < 0) die("socket");
        if (connect(p->fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
            fprintf(stderr, "cloadgen: publisher %ld: connect to %s:%d: %s\n", i, LOOPBACK, o.port, strerror(errno));
            return 1;
        }
        setsockopt(p->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char id[300];
        snprintf(id, sizeof id, "%s%ld", o.prefix, i);
        size_t len = encode_connect(pkt, id, o.username, o.keep_alive);
        uint8_t ack[4];
        struct timeval tv = {.tv_sec = 10};
        setsockopt(p->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (send_fully(p->fd, pkt, len) != 0 || recv(p->fd, ack, 4, MSG_WAITALL) != 4 || ack[0] != 0x20 ||
            ack[1] != 0x02 || ack[3] != 0x00) {
            fprintf(stderr, "cloadgen: publisher %ld: CONNECT not accepted\n", i);
            return 1;
        }
        if (fcntl(p->fd, F_SETFL, fcntl(p->fd, F_GETFL) | O_NONBLOCK) != 0) die("fcntl");
    }
    printf("{\"ready\": %ld}\n", o.n);
    fflush(stdout);

    /* "go" on stdin */
    char line[64];
    size_t got = 0;
    int go = 0;
    while (!go && !stop_requested && now_s() < deadline) {
        struct pollfd pf = {.fd = STDIN_FILENO, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0) continue;
        ssize_t r = read(STDIN_FILENO, line + got, sizeof line - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        line[got] = 0;
        if (strstr(line, "go\n")) go = 1;
        if (got == sizeof line - 1) got = 0;
    }
    double cpu0 = cpu_s(), t0 = now_s();
    int64_t t_start = realtime_ns();
    long active = o.n;
    if (!go) {
        for (long i = 0; i < o.n; i++) finish(&pubs[i], "never started");
        active = 0;
    }

    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    for (long i = 0; i < o.n && go; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, pubs[i].fd, &ev) != 0) die("epoll_ctl");
        pubs[i].last_ack = t0;
        if (fill_window(&o, &pubs[i], i) != 0) {
            finish(&pubs[i], "connection closed by the broker");
            active--;
        }
    }
    double stop_at = t0 + o.duration;
    struct epoll_event evs[MAX_EVENTS];
    static uint8_t rbuf[READ_BUF];
    while (active > 0) {
        double t = now_s();
        int sending = t < stop_at && !stop_requested;
        for (long i = 0; i < o.n; i++) { /* the end of each publisher: all acknowledged once sending stopped */
            struct pub *p = &pubs[i];
            if (p->done) continue;
            int sent_all = !sending || (o.count && p->sent >= o.count);
            if (sent_all && p->acked >= p->sent) {
                finish(p, NULL);
                active--;
            } else if (t > deadline || (sent_all && t - p->last_ack > ACK_SILENCE)) {
                snprintf(p->error_buf, sizeof p->error_buf, "%ld acknowledgements missing", p->sent - p->acked);
                finish(p, p->error_buf);
                active--;
            }
        }
        if (!active) break;
        int nev = epoll_wait(ep, evs, MAX_EVENTS, sending ? (int)((stop_at - t) * 1000) + 1 : 100);
        if (nev < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        t = now_s();
        sending = t < stop_at && !stop_requested;
        for (int k = 0; k < nev; k++) {
            long i = (long)evs[k].data.u64;
            struct pub *p = &pubs[i];
            if (p->done) continue;
            ssize_t r = recv(p->fd, rbuf, sizeof rbuf, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (r <= 0 || on_read(&o, p, rbuf, (size_t)r, t) != 0 || (sending && fill_window(&o, p, i) != 0)) {
                finish(p, r <= 0 ? "connection closed by the broker" : "unexpected packet or write failed");
                active--;
            }
        }
    }
    double cpu1 = cpu_s(), t1 = now_s();
    close(ep);
    printf("{\"cpu_s\": %.6f, \"elapsed\": %.6f, \"publishers\": [", cpu1 - cpu0, t1 - t0);
    for (long i = 0; i < o.n; i++) {
        struct pub *p = &pubs[i];
        printf("%s{\"pub\": %ld, \"sent\": %ld, \"acked\": %ld, \"t_start_ns\": %lld, \"t_end_ns\": %lld, ",
               i ? ", " : "", i, p->sent, p->acked, (long long)t_start, (long long)p->t_end_ns);
        if (p->error)
            printf("\"error\": \"%s\", ", p->error);
        else
            printf("\"error\": null, ");
        printf("\"acked_bitmap\": \"");
        for (long b = 0; b < (p->sent + 7) / 8; b++) printf("%02x", p->acked_bm[b]);
        printf("\"}");
        free(p->acked_bm);
    }
    printf("], \"generator\": \"cloadgen\"}\n");
    fflush(stdout);
    free(pubs);
    return 0;
}
