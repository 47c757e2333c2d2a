/*
 * mg-nbd-client: attach an NBD export to /dev/nbdN from the provisioning test VM's
 * initramfs (tests/support/harness/provision_vm.py compiles it with `gcc -static -O2`).
 *
 *   mg-nbd-client HOST PORT NAME [DEVICE]   (HOST an IP address; DEVICE: /dev/nbd0)
 *
 * The fixed-newstyle handshake (https://github.com/NetworkBlockDevice/nbd/blob/master/
 * doc/proto.md): NBD_OPT_GO with the export name (no info requests), falling back to
 * NBD_OPT_EXPORT_NAME when the server does not know NBD_OPT_GO; then the socket is handed
 * to the kernel (NBD_SET_SOCK, NBD_SET_BLKSIZE, NBD_SET_SIZE, NBD_SET_FLAGS) and a forked
 * child blocks in NBD_DO_IT for as long as the device lives; the parent returns 0 once the
 * device has its size (or 1 with the reason on stderr).  A name the server does not
 * export is refused by it (NBD_REP_ERR_UNKNOWN): exit 1, nothing attached.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/nbd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define NBDMAGIC 0x4e42444d41474943ULL    /* "NBDMAGIC" */
#define IHAVEOPT 0x49484156454F5054ULL    /* "IHAVEOPT" */
#define REPLY_MAGIC 0x0003e889045565a9ULL /* option reply */

#define FLAG_FIXED_NEWSTYLE 1u
#define FLAG_NO_ZEROES 2u

#define OPT_EXPORT_NAME 1u
#define OPT_GO 7u
#define REP_ACK 1u
#define REP_INFO 3u
#define REP_FLAG_ERROR 0x80000000u
#define REP_ERR_UNSUP (REP_FLAG_ERROR | 1u)
#define REP_ERR_UNKNOWN (REP_FLAG_ERROR | 6u)
#define INFO_EXPORT 0u

#define CONNECT_TRIES 50 /* 100 ms apart: the guest's network may still be coming up */
#define READY_WAIT_MS 10000

static const char *prog = "mg-nbd-client";

static void die(const char *fmt, const char *arg) {
  fprintf(stderr, "%s: ", prog);
  fprintf(stderr, fmt, arg);
  fputc('\n', stderr);
  exit(1);
}

static uint64_t be64(uint64_t v) {
  return ((uint64_t)htonl((uint32_t)v) << 32) | htonl((uint32_t)(v >> 32));
}

static void read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      die("%s", n == 0 ? "the server closed the connection during the handshake"
                       : strerror(errno));
    p += n;
    len -= (size_t)n;
  }
}

static void write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      die("write: %s", strerror(errno));
    p += n;
    len -= (size_t)n;
  }
}

static void skip(int fd, uint32_t len) {
  char buf[256];
  while (len > 0) {
    uint32_t chunk = len < sizeof buf ? len : (uint32_t)sizeof buf;
    read_all(fd, buf, chunk);
    len -= chunk;
  }
}

/* HOST is an address literal (IPv4 or IPv6): a static binary has no resolver. */
static int dial(const char *host, const char *port) {
  struct sockaddr_storage addr = {0};
  socklen_t addr_len;
  char *end = NULL;
  long p = strtol(port, &end, 10);
  if (end == port || *end != '\0' || p <= 0 || p > 65535)
    die("bad port %s", port);
  struct sockaddr_in *v4 = (struct sockaddr_in *)&addr;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&addr;
  if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)p);
    addr_len = sizeof *v4;
  } else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)p);
    addr_len = sizeof *v6;
  } else {
    die("the server must be an IP address, not %s", host);
  }
  for (int attempt = 0; attempt < CONNECT_TRIES; attempt++) {
    int fd = socket(addr.ss_family, SOCK_STREAM, 0);
    if (fd < 0)
      die("socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&addr, addr_len) == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    close(fd);
    usleep(100000);
  }
  die("cannot connect to the server: %s", strerror(errno));
  return -1;
}

static void send_option(int fd, uint32_t option, const void *data, uint32_t len) {
  uint64_t magic = be64(IHAVEOPT);
  uint32_t head[2] = {htonl(option), htonl(len)};
  write_all(fd, &magic, sizeof magic);
  write_all(fd, head, sizeof head);
  if (len > 0)
    write_all(fd, data, len);
}

/* NBD_OPT_GO: 1 and the size/flags on success, 0 when the server does not know GO. */
static int opt_go(int fd, const char *name, uint64_t *size, uint16_t *flags) {
  uint32_t name_len = (uint32_t)strlen(name);
  uint32_t len = 4 + name_len + 2;
  char *data = malloc(len);
  if (data == NULL)
    die("%s", "out of memory");
  uint32_t n = htonl(name_len);
  memcpy(data, &n, 4);
  memcpy(data + 4, name, name_len);
  memset(data + 4 + name_len, 0, 2); /* no information requests */
  send_option(fd, OPT_GO, data, len);
  free(data);
  int have_info = 0;
  for (;;) {
    uint64_t magic;
    uint32_t head[3];
    read_all(fd, &magic, sizeof magic);
    read_all(fd, head, sizeof head);
    uint32_t type = ntohl(head[1]), rlen = ntohl(head[2]);
    if (be64(magic) != REPLY_MAGIC)
      die("%s", "bad option reply magic");
    if (type == REP_ACK) {
      skip(fd, rlen);
      if (!have_info)
        die("%s", "the server sent no export information");
      return 1;
    }
    if (type == REP_INFO && rlen >= 2) {
      uint16_t info;
      read_all(fd, &info, 2);
      if (ntohs(info) == INFO_EXPORT && rlen == 12) {
        uint64_t s;
        uint16_t f;
        read_all(fd, &s, 8);
        read_all(fd, &f, 2);
        *size = be64(s);
        *flags = ntohs(f);
        have_info = 1;
      } else {
        skip(fd, rlen - 2);
      }
      continue;
    }
    if (type == REP_ERR_UNSUP) {
      skip(fd, rlen);
      return 0;
    }
    if (type & REP_FLAG_ERROR) {
      char msg[512] = "";
      uint32_t keep = rlen < sizeof msg - 1 ? rlen : (uint32_t)sizeof msg - 1;
      read_all(fd, msg, keep);
      skip(fd, rlen - keep);
      if (type == REP_ERR_UNKNOWN)
        die("the server refused the export name (unknown export) %s", msg);
      die("the server refused the export: %s", msg[0] ? msg : "error reply");
    }
    skip(fd, rlen);
  }
}

static void opt_export_name(int fd, const char *name, int no_zeroes, uint64_t *size,
                            uint16_t *flags) {
  send_option(fd, OPT_EXPORT_NAME, name, (uint32_t)strlen(name));
  uint64_t s;
  uint16_t f;
  read_all(fd, &s, 8); /* the server closes the connection on an unknown name */
  read_all(fd, &f, 2);
  if (!no_zeroes)
    skip(fd, 124);
  *size = be64(s);
  *flags = ntohs(f);
}

static int device_ready(const char *device) {
  const char *base = strrchr(device, '/');
  char path[128];
  snprintf(path, sizeof path, "/sys/block/%s/size", base ? base + 1 : device);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 0;
  unsigned long long sectors = 0;
  int ok = fscanf(f, "%llu", &sectors) == 1 && sectors > 0;
  fclose(f);
  return ok;
}

int main(int argc, char **argv) {
  if (argc < 4 || argc > 5) {
    fprintf(stderr, "usage: %s HOST PORT NAME [DEVICE]\n", prog);
    return 2;
  }
  const char *host = argv[1], *port = argv[2], *name = argv[3];
  const char *device = argc == 5 ? argv[4] : "/dev/nbd0";

  int sock = dial(host, port);
  uint64_t magic, opt;
  uint16_t hflags;
  read_all(sock, &magic, 8);
  read_all(sock, &opt, 8);
  read_all(sock, &hflags, 2);
  if (be64(magic) != NBDMAGIC || be64(opt) != IHAVEOPT)
    die("%s", "not a newstyle NBD server");
  hflags = ntohs(hflags);
  if (!(hflags & FLAG_FIXED_NEWSTYLE))
    die("%s", "the server does not speak fixed newstyle");
  int no_zeroes = (hflags & FLAG_NO_ZEROES) != 0;
  uint32_t cflags = htonl(FLAG_FIXED_NEWSTYLE | (no_zeroes ? FLAG_NO_ZEROES : 0));
  write_all(sock, &cflags, 4);

  uint64_t size = 0;
  uint16_t tflags = 0;
  if (!opt_go(sock, name, &size, &tflags))
    opt_export_name(sock, name, no_zeroes, &size, &tflags);
  if (size == 0)
    die("%s", "the export is empty");

  int dev = open(device, O_RDWR);
  if (dev < 0)
    die("cannot open the device: %s", strerror(errno));
  ioctl(dev, NBD_CLEAR_SOCK);
  if (ioctl(dev, NBD_SET_BLKSIZE, 512UL) < 0) /* any file system block size fits */
    die("NBD_SET_BLKSIZE: %s", strerror(errno));
  if (ioctl(dev, NBD_SET_SIZE, (unsigned long)size) < 0)
    die("NBD_SET_SIZE: %s", strerror(errno));
  if (ioctl(dev, NBD_SET_FLAGS, (unsigned long)tflags) < 0)
    die("NBD_SET_FLAGS: %s", strerror(errno));
  if (ioctl(dev, NBD_SET_SOCK, sock) < 0)
    die("NBD_SET_SOCK: %s", strerror(errno));

  pid_t child = fork();
  if (child < 0)
    die("fork: %s", strerror(errno));
  if (child == 0) {
    /* Serve the device until it is disconnected: survives switch_root and the new
       init's signals (it is the root file system's transport). */
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    setsid();
    if (ioctl(dev, NBD_DO_IT) < 0)
      fprintf(stderr, "%s: NBD_DO_IT ended: %s\n", prog, strerror(errno));
    ioctl(dev, NBD_CLEAR_SOCK);
    _exit(0);
  }
  close(sock);
  for (int waited = 0; waited < READY_WAIT_MS; waited += 10) {
    if (device_ready(device)) {
      printf("%s: %s attached: %s:%s, %llu bytes, flags 0x%x\n", prog, device, host, port,
             (unsigned long long)size, tflags);
      return 0;
    }
    usleep(10000);
  }
  kill(child, SIGKILL);
  die("%s did not come up", device);
  return 1;
}
