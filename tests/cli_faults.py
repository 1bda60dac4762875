"""tandem's real entry point with file-system faults injected, for what a test machine cannot
show by itself (tests run as root, where chmod does not make anything unreadable, and on roomy
disks):

    TANDEM_TEST_FULL=GLOB        writing a file whose name matches GLOB (Path.write_text, the
                                 way tandem writes its files) creates it, then fails with ENOSPC
    TANDEM_TEST_READONLY=DIR     DIR and everything under it is a read-only file system (EROFS)
    TANDEM_TEST_UNREADABLE=PATH  PATH cannot be opened (EACCES), and os.access says so too

    python tests/cli_faults.py ARGS...   # as `tandem ARGS...`
"""
from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import os
import pathlib
import sys


def _fail(code: int, path) -> OSError:
    return OSError(code, os.strerror(code), os.fspath(path))


def _under(path, root: str) -> bool:
    p = os.path.abspath(os.fspath(path))
    return p == root or p.startswith(root + os.sep)


def _install_full(pattern: str) -> None:
    write_text = pathlib.Path.write_text

    def full_write_text(self, data, *args, **kwargs):
        if fnmatch.fnmatch(self.name, pattern):
            write_text(self, "", *args, **kwargs)  # the file exists, as after a real ENOSPC
            raise _fail(errno.ENOSPC, self)
        return write_text(self, data, *args, **kwargs)

    pathlib.Path.write_text = full_write_text


def _install_readonly(root: str) -> None:
    real_open, real_os_open = builtins.open, os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def ro_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") \
                and _under(file, root):
            raise _fail(errno.EROFS, file)
        return real_open(file, mode, *args, **kwargs)

    def ro_os_open(path, flags, *args, **kwargs):
        if flags & writing and _under(path, root):
            raise _fail(errno.EROFS, path)
        return real_os_open(path, flags, *args, **kwargs)

    def guard(fn):
        def wrapper(path, *args, **kwargs):
            if _under(path, root):
                raise _fail(errno.EROFS, path)
            return fn(path, *args, **kwargs)
        return wrapper

    builtins.open = io.open = ro_open
    os.open = ro_os_open
    for name in ("mkdir", "unlink", "remove", "rmdir"):
        setattr(os, name, guard(getattr(os, name)))
    def guard2(fn):
        def wrapper(src, dst, *args, **kwargs):
            if _under(src, root) or _under(dst, root):
                raise _fail(errno.EROFS, dst)
            return fn(src, dst, *args, **kwargs)
        return wrapper

    for name in ("replace", "rename"):
        setattr(os, name, guard2(getattr(os, name)))


def _install_unreadable(target: str) -> None:
    real_open, real_access = builtins.open, os.access

    def no_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and _under(file, target):
            raise _fail(errno.EACCES, file)
        return real_open(file, *args, **kwargs)

    def no_access(path, mode, *args, **kwargs):
        if _under(path, target) and mode & os.R_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    builtins.open = io.open = no_open
    os.access = no_access


def install(env=os.environ) -> None:
    if env.get("TANDEM_TEST_FULL"):
        _install_full(env["TANDEM_TEST_FULL"])
    if env.get("TANDEM_TEST_READONLY"):
        _install_readonly(os.path.abspath(env["TANDEM_TEST_READONLY"]))
    if env.get("TANDEM_TEST_UNREADABLE"):
        _install_unreadable(os.path.abspath(env["TANDEM_TEST_UNREADABLE"]))


if __name__ == "__main__":
    install()
    sys.argv[0] = "tandem"
    from tandem.commands.app import main

    main()
