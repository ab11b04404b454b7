/*
 * cloadgen sub: the subscribers of the benchmarks' message rows in C (docs/benchmarks.md, "The C load generator").
 *
 * bench/loadgen.py's Python subscribers (run_subscribers, run_retained_subscribers) were the limit of the fan-out
 * and retained rows on the benchmark machine. This mode does their work on one thread with epoll and libc only:
 * MQTT 3.1.1 CONNECT and SUBSCRIBE written by hand, the PUBLISH stream framed by its Remaining Length (a packet cut
 * between two reads is carried over) and every payload checked as the Python subscribers check it.
 *
 *   cloadgen sub --port P --subscribers N --topic-filter F [--qos Q] [--pubs K] [--per-pub M] [--expect N]
 *                [--retained] [--at-once] [--latency] [--bitmaps] [--username U] [--client-id-prefix X]
 *                [--keep-alive S] [--timeout S] [--idle S] [--coalesce-us U] [--max-seq N] [--cpu K]
 *                [--host 127.0.0.1]
 *
 *   Opens N connections to 127.0.0.1:P, Client Identifiers X<i> (i = 0..N-1), CONNECT 3.1.1 with Clean Session 1,
 *   Keep Alive S (60) and user name U when given, then SUBSCRIBE F at QoS Q (0; Packet Identifier 1).
 *     default     each sends CONNECT, SUBSCRIBE once its CONNACK (return code 0) arrived; when every SUBACK
 *                 granted QoS Q it prints {"ready": N, ...} and counts what arrives from then on (run_subscribers).
 *     --at-once   the N TCP connections are made first, then {"ready": N, ...}; on the line "go" on stdin each
 *                 sends CONNECT and SUBSCRIBE in one write, all before any answer is read
 *                 (run_retained_subscribers: 100 clients subscribing to `#` at once).
 *   A refused CONNECT or SUBSCRIBE, or a connection closed before "ready", is an error (exit status 1).
 *
 *   Each PUBLISH's payload is 64 bytes: publisher id (2 bytes, big endian), sequence number (4), send time (8),
 *   padding (bench/loadgen.py's HEADER). Per subscriber:
 *     received      every PUBLISH
 *     unique        distinct (publisher, sequence number) pairs
 *     dups          a pair seen before
 *     out_of_order  a new pair whose sequence number is below the highest seen from its publisher
 *     bad           payload not 64 bytes, publisher id >= K, sequence number >= --max-seq (1 << 24, or M when
 *                   larger: the bitmaps' bound), or QoS above the Q subscribed to (a broker must deliver at the
 *                   granted QoS at most, MQTT 3.1.1 §3.8.4)
 *     dup_flag      QoS 1 or 2 PUBLISH with DUP set
 *     not_retained  PUBLISH without RETAIN
 *   Every QoS 1 PUBLISH is answered with PUBACK, every QoS 2 one with PUBREC and every PUBREL with PUBCOMP (§4.3),
 *   whatever its payload, in one write per read, as run_subscribers answers them.
 *   --retained checks as run_retained_subscribers does: the publisher id is not looked at, a sequence number
 *   >= --expect is bad, and order is not counted (the broker sends retained messages in its own order).
 *
 *   It stops when every open subscriber has N distinct messages (--expect N, or the line "expect N" on stdin),
 *   or --idle seconds (1) without data after that line (it says the publishers are done: run_subscribers's
 *   pubs_done; --expect alone never stops for want of data), or after --timeout seconds (60), or when every
 *   connection is closed, or at stdin's end or SIGTERM/SIGINT. It sends DISCONNECT on each open connection, closes
 *   it, and prints one JSON line:
 *     {"t_connect_ns": ns, "t_start_ns": ns, "cpu_s": s, "elapsed": s, "expect": n, "subscribers": [
 *       {"client_id", "received", "unique", "dups", "out_of_order", "bad", "dup_flag", "not_retained", "suback",
 *        "first_ns", "last_ns", "closed_by_broker", "session_present", "unique_per_pub"}, ...],
 *      "generator": "cloadgen"}
 *   --latency adds "latency_ns": [...] to each subscriber, for each distinct message the read's CLOCK_REALTIME
 *   minus the send time in its payload; --bitmaps adds "bitmaps": ["hex", ...], per publisher bit (s & 7) of
 *   byte s >> 3 set for each sequence number s received (run_subscribers's latency and bitmaps).
 *   Times in ns are CLOCK_REALTIME (Python's time.time_ns(), what the publishers put in their reports):
 *   t_connect_ns before the first connect, t_start_ns when "go" was read (--at-once) or at "ready", first_ns and
 *   last_ns the first and last read that brought a PUBLISH (--retained: a new distinct one). cpu_s is this
 *   process's user + system CPU from "ready" to the end, elapsed the wall time of the same span.
 *
 *   --coalesce-us U: after a round of reads whose largest was under 16 KiB, sleep U microseconds, so that a broker
 *   writing one packet per send() does not cost a wake-up per packet (bench/loadgen.py's COALESCE_SLEEP).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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
#define READ_BUF (256 * 1024)
#define CARRY_MAX 4096      /* the longest packet carried over between reads; longer ones are dropped (bad) */
#define COALESCE_BELOW 16384
#define STDIN_KEY UINT64_MAX

enum { SUB_OPEN, SUB_CONNECT_SENT, SUB_SUBSCRIBE_SENT, SUB_ACTIVE, SUB_CLOSED };

struct sub {
    int fd;
    uint8_t state;
    uint8_t suback;
    uint8_t session_present;
    uint32_t carry_len;
    uint64_t skip; /* bytes still to drop of a packet longer than CARRY_MAX (counted when it began) */
    long received, uniq, dups, ooo, bad, not_retained, dup_flag;
    int64_t *lat;        /* --latency: one sample per distinct message, ns */
    size_t lat_len, lat_cap;
    int64_t first_ns, last_ns;
    uint8_t **seen;      /* per publisher, a bitmap of sequence numbers */
    uint64_t *seen_bits; /* its size in bits */
    int64_t *last;       /* per publisher, the highest sequence number seen (-1: none) */
    long *uniq_per_pub;
    uint8_t carry[CARRY_MAX];
};

struct sub_opts {
    int port;
    long n;
    const char *topic_filter;
    const char *username;
    const char *prefix;
    long pubs;
    long per_pub;
    long expect;
    long max_seq;
    int retained;
    int at_once;
    int qos;
    int latency;
    int bitmaps;
    int keep_alive;
    double timeout;
    double idle;
    long coalesce_us;
};

struct run {
    const struct sub_opts *o;
    struct sub *subs;
    long expect;        /* -1 until known */
    int pubs_done;      /* "expect N" was read: --idle applies */
    int go;             /* "go" was read (--at-once) */
    int stdin_closed;   /* its end was read: stop */
    long open;          /* connections not closed */
    long complete;      /* open subscribers with `expect` distinct messages */
    long subacked;
    const char *error;  /* what went wrong before "ready" */
    long error_index;
    char stdin_buf[256];
    size_t stdin_len;
    int64_t read_ns;    /* CLOCK_REALTIME of the read being handled (--latency) */
    uint8_t *acks;      /* the acknowledgements of the read being handled */
    size_t acks_len;
};

static uint8_t subscribe_pkt[600];
static size_t subscribe_len;

/* SUBSCRIBE, MQTT 3.1.1 §3.8: fixed header 0x82, Packet Identifier 1, the filter and Requested QoS `qos` */
static void encode_subscribe(const char *filter, int qos) {
    size_t flen = strlen(filter), remaining = 2 + 2 + flen + 1, i = 0;
    subscribe_pkt[i++] = 0x82;
    do {
        uint8_t b = remaining & 0x7f;
        remaining >>= 7;
        subscribe_pkt[i++] = remaining ? (uint8_t)(b | 0x80) : b;
    } while (remaining);
    subscribe_pkt[i++] = 0x00;
    subscribe_pkt[i++] = 0x01;
    subscribe_pkt[i++] = (uint8_t)(flen >> 8);
    subscribe_pkt[i++] = (uint8_t)flen;
    memcpy(subscribe_pkt + i, filter, flen);
    i += flen;
    subscribe_pkt[i++] = (uint8_t)qos;
    subscribe_len = i;
}

/* the whole of `len` bytes on a non-blocking socket whose send buffer holds them (a fresh connection's); 0 or -1 */
static int send_all(int fd, const uint8_t *p, size_t len) {
    ssize_t w = send(fd, p, len, MSG_NOSIGNAL);
    return w == (ssize_t)len ? 0 : -1;
}

/* a 4-byte acknowledgement (PUBACK, PUBREC, PUBCOMP: §3.4, §3.5, §3.7) to send after the read being handled */
static void queue_ack(struct run *x, uint8_t first, uint8_t id_msb, uint8_t id_lsb) {
    uint8_t *a = x->acks + x->acks_len;
    a[0] = first;
    a[1] = 0x02;
    a[2] = id_msb;
    a[3] = id_lsb;
    x->acks_len += 4;
}

static void close_sub(struct run *x, struct sub *s) {
    if (s->state == SUB_CLOSED) return;
    if (x->expect >= 0 && s->uniq >= x->expect) x->complete--;
    close(s->fd); /* close() takes it out of the epoll set */
    s->fd = -1;
    s->state = SUB_CLOSED;
    x->open--;
}

static void fail_early(struct run *x, long i, const char *what) {
    if (!x->error) {
        x->error = what;
        x->error_index = i;
    }
}

/* bitmap of publisher `pub` large enough for `seq`; 0, or -1 past --max-seq */
static int reserve(struct run *x, struct sub *s, long pub, uint64_t seq) {
    if (seq < s->seen_bits[pub]) return 0;
    if ((long)seq >= x->o->max_seq) return -1;
    uint64_t bits = s->seen_bits[pub] ? s->seen_bits[pub] : 1024;
    while (bits <= seq) bits *= 2;
    if (bits > (uint64_t)x->o->max_seq) bits = (uint64_t)x->o->max_seq;
    uint8_t *m = realloc(s->seen[pub], (size_t)(bits + 7) / 8);
    if (!m) die("realloc");
    memset(m + (s->seen_bits[pub] + 7) / 8, 0, (size_t)((bits + 7) / 8 - (s->seen_bits[pub] + 7) / 8));
    s->seen[pub] = m;
    s->seen_bits[pub] = bits;
    return 0;
}

/* One PUBLISH: `flags` the fixed header's low nibble, `body` its variable header and payload. Returns 1 when it was
 * a new distinct message. */
static int on_publish(struct run *x, struct sub *s, uint8_t flags, const uint8_t *body, uint32_t len) {
    const struct sub_opts *o = x->o;
    s->received++;
    if (!(flags & 0x01)) s->not_retained++;
    int qos = (flags >> 1) & 0x03;
    if (len < 2) {
        s->bad++;
        return 0;
    }
    uint32_t tlen = ((uint32_t)body[0] << 8) | body[1];
    uint32_t head = 2 + tlen + (qos ? 2 : 0);
    if (qos && head <= len) { /* acknowledged whatever the payload, as run_subscribers does */
        queue_ack(x, qos == 1 ? 0x40 : 0x50, body[head - 2], body[head - 1]);
        if (flags & 0x08) s->dup_flag++;
    }
    if (qos > o->qos || head > len || len - head != PAYLOAD_SIZE) {
        s->bad++;
        return 0;
    }
    const uint8_t *p = body + head;
    long pub = o->retained ? 0 : (long)(((uint32_t)p[0] << 8) | p[1]);
    uint64_t seq = ((uint64_t)p[2] << 24) | ((uint64_t)p[3] << 16) | ((uint64_t)p[4] << 8) | p[5];
    if (pub >= o->pubs || (o->retained && (long)seq >= o->expect) || reserve(x, s, pub, seq) != 0) {
        s->bad++;
        return 0;
    }
    uint8_t *bm = s->seen[pub];
    uint8_t bit = (uint8_t)(1u << (seq & 7));
    if (bm[seq >> 3] & bit) {
        s->dups++;
        return 0;
    }
    bm[seq >> 3] |= bit;
    s->uniq++;
    s->uniq_per_pub[pub]++;
    if (!o->retained) {
        if ((int64_t)seq < s->last[pub])
            s->ooo++;
        else
            s->last[pub] = (int64_t)seq;
    }
    if (o->latency) {
        if (s->lat_len == s->lat_cap) {
            s->lat_cap = s->lat_cap ? s->lat_cap * 2 : 65536;
            int64_t *l = realloc(s->lat, s->lat_cap * sizeof *l);
            if (!l) die("realloc");
            s->lat = l;
        }
        uint64_t ts = 0;
        for (int k = 6; k < 14; k++) ts = ts << 8 | p[k];
        s->lat[s->lat_len++] = x->read_ns - (int64_t)ts;
    }
    if (x->expect >= 0 && s->uniq == x->expect) x->complete++;
    return 1;
}

/* The other packets a subscriber gets: CONNACK (then SUBSCRIBE, unless it went with the CONNECT) and SUBACK. */
static void on_control(struct run *x, long i, struct sub *s, uint8_t first, const uint8_t *body, uint32_t len) {
    uint8_t kind = first >> 4;
    if (kind == 2) { /* CONNACK §3.2: Session Present, return code */
        if (len != 2 || body[1] != 0x00) {
            fail_early(x, i, "CONNECT refused (CONNACK return code not 0)");
            return;
        }
        s->session_present = body[0] & 0x01;
        if (s->state == SUB_CONNECT_SENT) {
            if (send_all(s->fd, subscribe_pkt, subscribe_len) != 0) {
                fail_early(x, i, "SUBSCRIBE could not be sent");
                return;
            }
            s->state = SUB_SUBSCRIBE_SENT;
        }
    } else if (kind == 9) { /* SUBACK §3.9: Packet Identifier, one return code */
        if (len != 3 || body[0] != 0x00 || body[1] != 0x01 || body[2] != (uint8_t)x->o->qos) {
            fail_early(x, i, "SUBSCRIBE refused or answered with a QoS other than the one asked for");
            return;
        }
        if (!s->suback) x->subacked++;
        s->suback = 1;
        s->state = SUB_ACTIVE;
    } else if (kind == 6 && len == 2) { /* PUBREL §3.6: PUBCOMP (the message was counted at its PUBLISH) */
        queue_ack(x, 0x70, body[0], body[1]);
    } /* anything else (PINGRESP: none is asked for) is not counted */
}

/* Frames buf[0..len) into packets (fixed header, Remaining Length §2.2.3) and handles each complete one. Returns
 * the bytes consumed; an incomplete packet at the end is left. *new_unique is set when a distinct message came;
 * *publishes counts the PUBLISH packets. -1: a malformed Remaining Length (more than four bytes). */
static long frame(struct run *x, long i, struct sub *s, uint8_t *buf, size_t len, int *new_unique, long *publishes) {
    size_t pos = 0;
    while (pos + 2 <= len) {
        uint32_t rl = 0, shift = 0;
        size_t hdr = 1;
        int complete = 0;
        while (pos + hdr < len && hdr <= 4) {
            uint8_t b = buf[pos + hdr++];
            rl |= (uint32_t)(b & 0x7f) << shift;
            shift += 7;
            if (!(b & 0x80)) {
                complete = 1;
                break;
            }
        }
        if (!complete) {
            if (hdr > 4) return -1;
            break;
        }
        uint8_t first = buf[pos];
        if (pos + hdr + rl > len) {
            if (hdr + rl > CARRY_MAX) { /* too long to carry over: drop it, and what is still to come of it */
                s->skip = pos + hdr + rl - len;
                if ((first >> 4) == 3) { /* a PUBLISH: received, and bad (no payload of ours is that long) */
                    (*publishes)++;
                    s->received++;
                    s->bad++;
                    if (!(first & 0x01)) s->not_retained++;
                }
                pos = len;
            }
            break;
        }
        if ((first >> 4) == 3) {
            (*publishes)++;
            *new_unique |= on_publish(x, s, first & 0x0f, buf + pos + hdr, rl);
        } else {
            on_control(x, i, s, first, buf + pos + hdr, rl);
        }
        pos += hdr + rl;
    }
    return (long)pos;
}

static uint8_t rbuf[READ_BUF];
/* at most one 4-byte acknowledgement per packet of a read, and a packet is at least 2 bytes */
static uint8_t abuf[(READ_BUF + CARRY_MAX) * 2];

/* One read of subscriber i; returns the bytes read (0: closed). */
static ssize_t read_sub(struct run *x, long i) {
    struct sub *s = &x->subs[i];
    uint32_t carried = s->carry_len;
    memcpy(rbuf, s->carry, carried);
    ssize_t r = recv(s->fd, rbuf + carried, READ_BUF - carried, 0);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return -1;
    if (r <= 0) {
        close_sub(x, s);
        return 0;
    }
    uint8_t *buf = rbuf;
    size_t len = carried + (size_t)r;
    if (s->skip) { /* carried is 0 while a long packet is dropped */
        size_t d = s->skip < len ? (size_t)s->skip : len;
        s->skip -= d;
        buf += d;
        len -= d;
    }
    int new_unique = 0;
    long publishes = 0;
    if (x->o->latency) x->read_ns = realtime_ns();
    x->acks = abuf;
    x->acks_len = 0;
    long used = frame(x, i, s, buf, len, &new_unique, &publishes);
    if (x->acks_len && send_fully(s->fd, abuf, x->acks_len) != 0) {
        close_sub(x, s);
        return r;
    }
    if (used < 0) {
        fprintf(stderr, "cloadgen: subscriber %ld: malformed Remaining Length: connection closed\n", i);
        s->bad++;
        close_sub(x, s);
        return r;
    }
    s->carry_len = (uint32_t)(len - (size_t)used);
    memcpy(s->carry, buf + used, s->carry_len);
    if (x->o->retained ? new_unique : publishes > 0) {
        int64_t t = realtime_ns();
        if (!s->first_ns) s->first_ns = t;
        s->last_ns = t;
    }
    return r;
}

/* The control lines on stdin: "go", "expect N"; its end stops the run. */
static void read_stdin(struct run *x) {
    ssize_t r = read(STDIN_FILENO, x->stdin_buf + x->stdin_len, sizeof x->stdin_buf - 1 - x->stdin_len);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (r <= 0) {
        x->stdin_closed = 1;
        return;
    }
    x->stdin_len += (size_t)r;
    x->stdin_buf[x->stdin_len] = 0;
    char *line = x->stdin_buf, *nl;
    while ((nl = strchr(line, '\n'))) {
        *nl = 0;
        if (strcmp(line, "go") == 0) {
            x->go = 1;
        } else if (strncmp(line, "expect ", 7) == 0) {
            x->expect = strtol(line + 7, NULL, 10);
            x->pubs_done = 1;
            x->complete = 0;
            for (long i = 0; i < x->o->n; i++)
                if (x->subs[i].state != SUB_CLOSED && x->subs[i].uniq >= x->expect) x->complete++;
        } else if (*line) {
            fprintf(stderr, "cloadgen: unknown control line: %s\n", line);
        }
        line = nl + 1;
    }
    x->stdin_len = strlen(line);
    memmove(x->stdin_buf, line, x->stdin_len);
    if (x->stdin_len == sizeof x->stdin_buf - 1) x->stdin_len = 0; /* no line is that long: drop it */
}

static void print_report(const struct run *x, int64_t t_connect, int64_t t_start, double cpu, double elapsed) {
    const struct sub_opts *o = x->o;
    printf("{\"t_connect_ns\": %lld, \"t_start_ns\": %lld, \"cpu_s\": %.6f, \"elapsed\": %.6f, \"expect\": %ld, "
           "\"subscribers\": [",
           (long long)t_connect, (long long)t_start, cpu, elapsed, x->expect);
    for (long i = 0; i < o->n; i++) {
        const struct sub *s = &x->subs[i];
        printf("%s{\"client_id\": \"%s%ld\", \"received\": %ld, \"unique\": %ld, \"dups\": %ld, \"out_of_order\": %ld, "
               "\"bad\": %ld, \"dup_flag\": %ld, \"not_retained\": %ld, \"suback\": %s, \"first_ns\": %lld, "
               "\"last_ns\": %lld, \"closed_by_broker\": %s, \"session_present\": %s, \"unique_per_pub\": [",
               i ? ", " : "", o->prefix, i, s->received, s->uniq, s->dups, s->ooo, s->bad, s->dup_flag,
               s->not_retained,
               s->suback ? "true" : "false", (long long)s->first_ns, (long long)s->last_ns,
               s->state == SUB_CLOSED ? "true" : "false", s->session_present ? "true" : "false");
        for (long p = 0; p < o->pubs; p++) printf("%s%ld", p ? ", " : "", s->uniq_per_pub[p]);
        printf("]");
        if (o->latency) {
            printf(", \"latency_ns\": [");
            for (size_t k = 0; k < s->lat_len; k++) printf("%s%lld", k ? ", " : "", (long long)s->lat[k]);
            printf("]");
        }
        if (o->bitmaps) {
            printf(", \"bitmaps\": [");
            for (long p = 0; p < o->pubs; p++) {
                uint64_t bytes = s->last[p] < 0 ? 0 : ((uint64_t)s->last[p] + 8) / 8;
                printf("%s\"", p ? ", " : "");
                for (uint64_t b = 0; b < bytes && b < (s->seen_bits[p] + 7) / 8; b++) printf("%02x", s->seen[p][b]);
                printf("\"");
            }
            printf("]");
        }
        printf("}");
    }
    printf("], \"generator\": \"cloadgen\"}\n");
    fflush(stdout);
}

int run_sub(int argc, char **argv) {
    struct sub_opts o = {.port = 0, .n = 0, .topic_filter = NULL, .username = NULL, .prefix = NULL, .pubs = 1,
                         .per_pub = 1024, .expect = -1, .max_seq = 1L << 24, .retained = 0, .at_once = 0,
                         .keep_alive = 60, .timeout = 60.0, .idle = 1.0, .coalesce_us = 0};
    int cpu = -1;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "sub-c%ld-", (long)getpid());
    o.prefix = prefix;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--retained") == 0) {
            o.retained = 1;
            continue;
        }
        if (strcmp(a, "--at-once") == 0) {
            o.at_once = 1;
            continue;
        }
        if (strcmp(a, "--latency") == 0) {
            o.latency = 1;
            continue;
        }
        if (strcmp(a, "--bitmaps") == 0) {
            o.bitmaps = 1;
            continue;
        }
        if (i + 1 >= argc) usage("every option but --retained, --at-once, --latency and --bitmaps takes a value");
        const char *v = argv[++i];
        int common = client_option(a, v, &o.port, &o.username, &o.prefix, &o.keep_alive, &o.timeout, &cpu);
        if (common < 0) return 2;
        if (common) continue;
        if (strcmp(a, "--subscribers") == 0) {
            o.n = parse_long(v, "subscribers", 1, 100000);
        } else if (strcmp(a, "--topic-filter") == 0) {
            if (!*v || strlen(v) > 256) usage("the topic filter is 1 to 256 bytes");
            o.topic_filter = v;
        } else if (strcmp(a, "--qos") == 0) {
            o.qos = (int)parse_long(v, "qos", 0, 2);
        } else if (strcmp(a, "--pubs") == 0) {
            o.pubs = parse_long(v, "pubs", 1, 65536);
        } else if (strcmp(a, "--per-pub") == 0) {
            o.per_pub = parse_long(v, "per-pub", 1, 1L << 32);
        } else if (strcmp(a, "--expect") == 0) {
            o.expect = parse_long(v, "expect", 0, 1L << 32);
        } else if (strcmp(a, "--max-seq") == 0) {
            o.max_seq = parse_long(v, "max-seq", 1, 1L << 32);
        } else if (strcmp(a, "--idle") == 0) {
            o.idle = parse_seconds(v, "idle");
        } else if (strcmp(a, "--coalesce-us") == 0) {
            o.coalesce_us = parse_long(v, "coalesce-us", 0, 1000000);
        } else {
            char msg[128];
            snprintf(msg, sizeof msg, "unknown option %s", a);
            usage(msg);
        }
    }
    if (!o.port || !o.n || !o.topic_filter) usage("sub needs --port, --subscribers and --topic-filter");
    if (o.retained && o.expect < 0) usage("--retained needs --expect (the number of retained messages)");
    if (o.retained) {
        o.pubs = 1;
        if (o.max_seq < o.expect) o.max_seq = o.expect;
    }
    if (o.max_seq < o.per_pub) o.max_seq = o.per_pub;
    pin_cpu(cpu);
    raise_nofile(o.n + 64, 1);
    encode_subscribe(o.topic_filter, o.qos);

    /* --expect alone never stops the run for want of data (the retained row waits for a slow broker until the
     * deadline, as run_retained_subscribers does); "expect N" says the publishers are done, and --idle applies */
    struct run x = {.o = &o, .expect = o.expect, .pubs_done = 0, .open = 0, .error_index = -1};
    x.subs = calloc((size_t)o.n, sizeof *x.subs);
    if (!x.subs) die("calloc");
    for (long i = 0; i < o.n; i++) {
        struct sub *s = &x.subs[i];
        s->fd = -1;
        s->seen = calloc((size_t)o.pubs, sizeof *s->seen);
        s->seen_bits = calloc((size_t)o.pubs, sizeof *s->seen_bits);
        s->last = malloc((size_t)o.pubs * sizeof *s->last);
        s->uniq_per_pub = calloc((size_t)o.pubs, sizeof *s->uniq_per_pub);
        if (!s->seen || !s->seen_bits || !s->last || !s->uniq_per_pub) die("calloc");
        for (long p = 0; p < o.pubs; p++) {
            s->last[p] = -1;
            uint64_t bits = (uint64_t)(o.retained ? o.expect : o.per_pub);
            s->seen[p] = calloc((size_t)(bits + 7) / 8 + 1, 1);
            if (!s->seen[p]) die("calloc");
            s->seen_bits[p] = bits;
        }
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o.port)};
    inet_pton(AF_INET, LOOPBACK, &addr.sin_addr);
    int one = 1;
    uint8_t connect_pkt[600];
    double deadline = now_s() + o.timeout;

    /* connect: every socket (blocking connect on loopback: it completes at once while the listen queue has room) */
    int64_t t_connect = realtime_ns();
    for (long i = 0; i < o.n; i++) {
        struct sub *s = &x.subs[i];
        s->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s->fd < 0) die("socket");
        if (connect(s->fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
            fprintf(stderr, "cloadgen: subscriber %ld: connect to %s:%d: %s\n", i, LOOPBACK, o.port, strerror(errno));
            return 1;
        }
        setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (fcntl(s->fd, F_SETFL, fcntl(s->fd, F_GETFL) | O_NONBLOCK) != 0) die("fcntl");
        struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, s->fd, &ev) != 0) die("epoll_ctl");
        s->state = SUB_OPEN;
        x.open++;
    }
    struct epoll_event evs[MAX_EVENTS];
    {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLHUP, .data.u64 = STDIN_KEY};
        /* not a pipe or terminal (a file, /dev/null): no control lines, the run ends by --expect, --idle or
         * --timeout (and --at-once never starts) */
        epoll_ctl(ep, EPOLL_CTL_ADD, STDIN_FILENO, &ev);
    }

    /* the default start: CONNECT, SUBSCRIBE on its CONNACK, "ready" when every SUBACK is in */
    if (!o.at_once) {
        for (long i = 0; i < o.n; i++) {
            struct sub *s = &x.subs[i];
            char id[300];
            snprintf(id, sizeof id, "%s%ld", o.prefix, i);
            if (send_all(s->fd, connect_pkt, encode_connect(connect_pkt, id, o.username, o.keep_alive)) != 0) {
                fprintf(stderr, "cloadgen: subscriber %ld: CONNECT could not be sent: %s\n", i, strerror(errno));
                return 1;
            }
            s->state = SUB_CONNECT_SENT;
        }
        while (x.subacked < o.n && !x.error && x.open == o.n && !stop_requested && !x.stdin_closed) {
            double left = deadline - now_s();
            if (left <= 0) break;
            int nev = epoll_wait(ep, evs, MAX_EVENTS, left > 0.1 ? 100 : (int)(left * 1000) + 1);
            if (nev < 0) {
                if (errno == EINTR) continue;
                die("epoll_wait");
            }
            for (int k = 0; k < nev; k++) {
                if (evs[k].data.u64 == STDIN_KEY)
                    read_stdin(&x);
                else if (x.subs[evs[k].data.u64].state != SUB_CLOSED)
                    read_sub(&x, (long)evs[k].data.u64);
            }
        }
        if (x.subacked < o.n) {
            if (x.error)
                fprintf(stderr, "cloadgen: subscriber %ld: %s\n", x.error_index, x.error);
            else
                fprintf(stderr, "cloadgen: %ld of %ld subscriptions acknowledged, %ld connections closed%s\n",
                        x.subacked, o.n, o.n - x.open, now_s() >= deadline ? ", timed out" : "");
            return 1;
        }
    }
    printf("{\"ready\": %ld, \"subscribers\": %ld}\n", o.n, o.n);
    fflush(stdout);
    double cpu0 = cpu_s(), t0 = now_s();
    int64_t t_start = realtime_ns();

    /* --at-once: "go" on stdin, then CONNECT + SUBSCRIBE in one write on every connection */
    if (o.at_once) {
        while (!x.go && !stop_requested && !x.stdin_closed && now_s() < deadline) {
            int nev = epoll_wait(ep, evs, MAX_EVENTS, 100);
            if (nev < 0 && errno != EINTR) die("epoll_wait");
            for (int k = 0; k < nev; k++) {
                if (evs[k].data.u64 == STDIN_KEY)
                    read_stdin(&x);
                else if (x.subs[evs[k].data.u64].state != SUB_CLOSED)
                    read_sub(&x, (long)evs[k].data.u64);
            }
        }
        cpu0 = cpu_s();
        t0 = now_s();
        t_start = realtime_ns();
        if (x.go) {
            uint8_t pkt[1200];
            for (long i = 0; i < o.n; i++) {
                struct sub *s = &x.subs[i];
                if (s->state == SUB_CLOSED) continue;
                char id[300];
                snprintf(id, sizeof id, "%s%ld", o.prefix, i);
                size_t len = encode_connect(pkt, id, o.username, o.keep_alive);
                memcpy(pkt + len, subscribe_pkt, subscribe_len);
                if (send_all(s->fd, pkt, len + subscribe_len) != 0)
                    close_sub(&x, s);
                else
                    s->state = SUB_SUBSCRIBE_SENT;
            }
        }
    }

    /* receive and check */
    int running = !o.at_once || x.go;
    double last_data = now_s();
    while (running && x.open > 0 && !stop_requested && !x.stdin_closed) {
        double t = now_s();
        if (t >= deadline) break;
        if (x.expect >= 0 && x.complete >= x.open) break;
        if (x.pubs_done && t - last_data > o.idle) break;
        int nev = epoll_wait(ep, evs, MAX_EVENTS, 50);
        if (nev < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        ssize_t largest = 0;
        for (int k = 0; k < nev; k++) {
            if (evs[k].data.u64 == STDIN_KEY) {
                read_stdin(&x);
                continue;
            }
            struct sub *s = &x.subs[evs[k].data.u64];
            if (s->state == SUB_CLOSED) continue;
            ssize_t r = read_sub(&x, (long)evs[k].data.u64);
            if (r > largest) largest = r;
        }
        if (largest > 0) last_data = now_s();
        if (o.coalesce_us && largest > 0 && largest < COALESCE_BELOW) usleep((useconds_t)o.coalesce_us);
    }
    double cpu1 = cpu_s(), t1 = now_s();
    static const uint8_t disconnect[2] = {0xe0, 0x00};
    for (long i = 0; i < o.n; i++) {
        struct sub *s = &x.subs[i];
        if (s->state == SUB_CLOSED) continue;
        send(s->fd, disconnect, sizeof disconnect, MSG_NOSIGNAL);
        close(s->fd);
    }
    print_report(&x, t_connect, t_start, cpu1 - cpu0, t1 - t0);
    close(ep);
    for (long i = 0; i < o.n; i++) {
        struct sub *s = &x.subs[i];
        for (long p = 0; p < o.pubs; p++) free(s->seen[p]);
        free(s->seen);
        free(s->seen_bits);
        free(s->last);
        free(s->uniq_per_pub);
        free(s->lat);
    }
    free(x.subs);
    return 0;
}
