/*
 * A stand-in for a parallel file system: every metadata call on a path under one folder waits
 * a fixed time first. Built by benchmarks/startup/slowfs.py and loaded with LD_PRELOAD.
 *
 *   MDL_SLOWFS_ROOT  absolute folder whose paths are slowed (nothing is slowed when unset)
 *   MDL_SLOWFS_US    microseconds to wait per call (default 1000)
 *
 * Calls slowed: open, openat, their 64-bit and fortified variants, fopen, stat, lstat,
 * fstatat, statx (and glibc's older __xstat family), access, faccessat, opendir. Reads,
 * writes and calls on open descriptors are not slowed: on a parallel file system the metadata
 * server answers the former, the data servers the latter. Imports and libraries outside the
 * folder keep their speed, so the benchmark measures the data tree only.
 */
#define _GNU_SOURCE
#undef _FORTIFY_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *slow_root = NULL;
static size_t slow_len = 0;
static long slow_ns = 1000000L;
static int ready = 0;

static void setup(void) {
    if (ready) return;
    const char *root = getenv("MDL_SLOWFS_ROOT");
    const char *us = getenv("MDL_SLOWFS_US");
    if (root && root[0] == '/') {
        slow_root = root;
        slow_len = strlen(root);
        while (slow_len > 1 && slow_root[slow_len - 1] == '/') slow_len--;
    }
    if (us) slow_ns = atol(us) * 1000L;
    ready = 1;
}

/* Whether `path` (absolute, or relative to the working folder) lies under the slow folder. */
static int under_root(int dirfd, const char *path) {
    setup();
    if (!slow_root || !path) return 0;
    if (path[0] != '/') {
        if (dirfd != AT_FDCWD) return 0; /* relative to an open folder: not tracked */
        char cwd[4096];
        if (!getcwd(cwd, sizeof cwd)) return 0;
        size_t n = strlen(cwd);
        return strncmp(cwd, slow_root, slow_len) == 0 && (n == slow_len || cwd[slow_len] == '/');
    }
    return strncmp(path, slow_root, slow_len) == 0
           && (path[slow_len] == '\0' || path[slow_len] == '/');
}

static void wait_if_slow(int dirfd, const char *path) {
    if (under_root(dirfd, path) && slow_ns > 0) {
        struct timespec t = {slow_ns / 1000000000L, slow_ns % 1000000000L};
        while (nanosleep(&t, &t) != 0) {}
    }
}

/* The next definition of `name` (libc's): looked up once, on first use. */
#define REAL(name) \
    static __typeof__(&name) real_##name = NULL; \
    if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

static mode_t mode_of(int flags, va_list ap) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t mode = mode_of(flags, ap); va_end(ap);
    REAL(open);
    wait_if_slow(AT_FDCWD, path);
    return real_open(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t mode = mode_of(flags, ap); va_end(ap);
    REAL(open64);
    wait_if_slow(AT_FDCWD, path);
    return real_open64(path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t mode = mode_of(flags, ap); va_end(ap);
    REAL(openat);
    wait_if_slow(dirfd, path);
    return real_openat(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t mode = mode_of(flags, ap); va_end(ap);
    REAL(openat64);
    wait_if_slow(dirfd, path);
    return real_openat64(dirfd, path, flags, mode);
}

int __open_2(const char *path, int flags) {
    REAL(__open_2);
    wait_if_slow(AT_FDCWD, path);
    return real___open_2(path, flags);
}

int __open64_2(const char *path, int flags) {
    REAL(__open64_2);
    wait_if_slow(AT_FDCWD, path);
    return real___open64_2(path, flags);
}

int __openat_2(int dirfd, const char *path, int flags) {
    REAL(__openat_2);
    wait_if_slow(dirfd, path);
    return real___openat_2(dirfd, path, flags);
}

FILE *fopen(const char *path, const char *mode) {
    REAL(fopen);
    wait_if_slow(AT_FDCWD, path);
    return real_fopen(path, mode);
}

FILE *fopen64(const char *path, const char *mode) {
    REAL(fopen64);
    wait_if_slow(AT_FDCWD, path);
    return real_fopen64(path, mode);
}

int stat(const char *path, struct stat *buf) {
    REAL(stat);
    wait_if_slow(AT_FDCWD, path);
    return real_stat(path, buf);
}

int stat64(const char *path, struct stat64 *buf) {
    REAL(stat64);
    wait_if_slow(AT_FDCWD, path);
    return real_stat64(path, buf);
}

int lstat(const char *path, struct stat *buf) {
    REAL(lstat);
    wait_if_slow(AT_FDCWD, path);
    return real_lstat(path, buf);
}

int lstat64(const char *path, struct stat64 *buf) {
    REAL(lstat64);
    wait_if_slow(AT_FDCWD, path);
    return real_lstat64(path, buf);
}

int fstatat(int dirfd, const char *path, struct stat *buf, int flags) {
    REAL(fstatat);
    if (!(flags & AT_EMPTY_PATH) || (path && path[0])) wait_if_slow(dirfd, path);
    return real_fstatat(dirfd, path, buf, flags);
}

int fstatat64(int dirfd, const char *path, struct stat64 *buf, int flags) {
    REAL(fstatat64);
    if (!(flags & AT_EMPTY_PATH) || (path && path[0])) wait_if_slow(dirfd, path);
    return real_fstatat64(dirfd, path, buf, flags);
}

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    REAL(statx);
    if (!(flags & AT_EMPTY_PATH) || (path && path[0])) wait_if_slow(dirfd, path);
    return real_statx(dirfd, path, flags, mask, buf);
}

int __xstat(int ver, const char *path, struct stat *buf) {
    REAL(__xstat);
    wait_if_slow(AT_FDCWD, path);
    return real___xstat(ver, path, buf);
}

int __xstat64(int ver, const char *path, struct stat64 *buf) {
    REAL(__xstat64);
    wait_if_slow(AT_FDCWD, path);
    return real___xstat64(ver, path, buf);
}

int __lxstat(int ver, const char *path, struct stat *buf) {
    REAL(__lxstat);
    wait_if_slow(AT_FDCWD, path);
    return real___lxstat(ver, path, buf);
}

int __lxstat64(int ver, const char *path, struct stat64 *buf) {
    REAL(__lxstat64);
    wait_if_slow(AT_FDCWD, path);
    return real___lxstat64(ver, path, buf);
}

int __fxstatat(int ver, int dirfd, const char *path, struct stat *buf, int flags) {
    REAL(__fxstatat);
    wait_if_slow(dirfd, path);
    return real___fxstatat(ver, dirfd, path, buf, flags);
}

int __fxstatat64(int ver, int dirfd, const char *path, struct stat64 *buf, int flags) {
    REAL(__fxstatat64);
    wait_if_slow(dirfd, path);
    return real___fxstatat64(ver, dirfd, path, buf, flags);
}

int access(const char *path, int mode) {
    REAL(access);
    wait_if_slow(AT_FDCWD, path);
    return real_access(path, mode);
}

int faccessat(int dirfd, const char *path, int mode, int flags) {
    REAL(faccessat);
    wait_if_slow(dirfd, path);
    return real_faccessat(dirfd, path, mode, flags);
}

DIR *opendir(const char *path) {
    REAL(opendir);
    wait_if_slow(AT_FDCWD, path);
    return real_opendir(path);
}
