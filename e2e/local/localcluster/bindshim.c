/*
 * LD_PRELOAD shim for the local cluster's pods: all pods share the host's network
 * namespace, so a bind() to the wildcard address (0.0.0.0 or ::) is turned into a bind
 * to the pod's own loopback IP, taken from $PDCLUSTER_POD_IP. Many pods can then all
 * listen on :8000, as they would in their own network namespaces, and manifests keep
 * their usual wildcard binds.
 *
 * An IPv6-only socket cannot take an IPv4 pod address; it is bound to [::1]:0 instead,
 * so that servers binding both families (asyncio with host=None) still start and serve
 * on the pod IP.
 *
 * connect() from an unbound IPv4 socket to a loopback address first binds the socket to
 * <pod ip>:0, so peers see the pod's IP as the source address, as they would in a cluster.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*sockaddr_fn)(int, const struct sockaddr *, socklen_t);

static sockaddr_fn real(const char *name) {
    return (sockaddr_fn)dlsym(RTLD_NEXT, name);
}

/* The pod IP from the environment; 0 if there is none. */
static int pod_ip(struct in_addr *ip) {
    const char *text = getenv("PDCLUSTER_POD_IP");
    return text && inet_pton(AF_INET, text, ip) == 1;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static sockaddr_fn real_connect, real_bind;
    if (!real_connect) {
        real_connect = real("connect");
        real_bind = real("bind");
    }
    struct in_addr ip;
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in) && pod_ip(&ip)) {
        const struct sockaddr_in *to = (const struct sockaddr_in *)addr;
        struct sockaddr_in self;
        socklen_t self_len = sizeof self;
        int loopback = (ntohl(to->sin_addr.s_addr) >> 24) == 127;
        if (loopback && getsockname(fd, (struct sockaddr *)&self, &self_len) == 0 && self.sin_family == AF_INET &&
            self.sin_addr.s_addr == htonl(INADDR_ANY) && self.sin_port == 0) {
            struct sockaddr_in source = {.sin_family = AF_INET, .sin_port = 0, .sin_addr = ip};
            real_bind(fd, (struct sockaddr *)&source, sizeof source); /* best effort */
        }
    }
    return real_connect(fd, addr, len);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static sockaddr_fn real_bind;
    if (!real_bind)
        real_bind = real("bind");

    struct in_addr ip;
    if (!addr || !pod_ip(&ip))
        return real_bind(fd, addr, len);

    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in v4;
        memcpy(&v4, addr, sizeof v4);
        if (v4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            v4.sin_addr = ip;
            return real_bind(fd, (struct sockaddr *)&v4, sizeof v4);
        }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 v6;
        memcpy(&v6, addr, sizeof v6);
        if (IN6_IS_ADDR_UNSPECIFIED(&v6.sin6_addr)) {
            int v6only = 0;
            socklen_t optlen = sizeof v6only;
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen);
            if (v6only) {
                v6.sin6_addr = in6addr_loopback;
                v6.sin6_port = 0;
            } else {
                /* IPv4-mapped ::ffff:<pod ip>: the dual-stack socket serves the pod IP. */
                memset(&v6.sin6_addr, 0, sizeof v6.sin6_addr);
                v6.sin6_addr.s6_addr[10] = 0xff;
                v6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&v6.sin6_addr.s6_addr[12], &ip, 4);
            }
            return real_bind(fd, (struct sockaddr *)&v6, sizeof v6);
        }
    }
    return real_bind(fd, addr, len);
}
