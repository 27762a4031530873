"""How the store makes a batch durable, and how files are opened for writing.

A batch of payloads and records is flushed with one syncfs only where that
is known to write everything back (a local file system, one device, syncfs
reporting success); anything else falls back to an fsync per file, which
reports every error. A file written over in place is never more open than
the content going into it.
"""

import os
import shutil
import stat
import sys
import tempfile
import unittest

import support

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402

LINUX = sys.platform.startswith("linux")


class FakeLibc:
    def __init__(self, result):
        self.result = result
        self.calls = 0

    def syncfs(self, fd):
        self.calls += 1
        return self.result


class FlushTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tc-flush-")
        self.saved = (list(tc._LIBC), dict(tc._SYNCFS_TRUST), tc.fsync_paths, tc.unwritten_bytes)
        self.fsynced = []
        tc.fsync_paths = lambda paths: self.fsynced.append(list(paths))
        tc.unwritten_bytes = lambda: 0

    def tearDown(self):
        tc._LIBC[:] = self.saved[0]
        tc._SYNCFS_TRUST.clear()
        tc._SYNCFS_TRUST.update(self.saved[1])
        tc.fsync_paths, tc.unwritten_bytes = self.saved[2], self.saved[3]
        shutil.rmtree(self.tmp, ignore_errors=True)

    def store_with_pending(self, count=5):
        payloads = tc.PayloadStore(os.path.join(self.tmp, "payload"))
        for i in range(count):
            payloads.put_bytes(("content %d" % i).encode())
        return payloads

    @unittest.skipUnless(LINUX, "syncfs is Linux only")
    def test_a_failing_syncfs_falls_back_to_fsyncs(self):
        tc._LIBC[:] = [FakeLibc(-1)]
        tc._SYNCFS_TRUST[os.path.join(self.tmp, "payload")] = True
        payloads = self.store_with_pending()
        payloads.flush_with([])
        self.assertEqual(tc._LIBC[0].calls, 1)
        self.assertEqual(len(self.fsynced), 1, "no fsync after syncfs failed")
        self.assertEqual(len([p for p in self.fsynced[0] if os.path.isfile(p)]), 5)

    @unittest.skipUnless(LINUX, "syncfs is Linux only")
    def test_a_working_syncfs_replaces_the_fsyncs(self):
        tc._LIBC[:] = [FakeLibc(0)]
        tc._SYNCFS_TRUST[os.path.join(self.tmp, "payload")] = True
        self.store_with_pending().flush_with([])
        self.assertEqual(tc._LIBC[0].calls, 1)
        self.assertEqual(self.fsynced, [])

    @unittest.skipUnless(LINUX, "syncfs is Linux only")
    def test_syncfs_is_not_trusted_on_file_systems_outside_the_list(self):
        tc._LIBC[:] = [FakeLibc(0)]
        tc._SYNCFS_TRUST[os.path.join(self.tmp, "payload")] = False
        self.store_with_pending().flush_with([])
        self.assertEqual(tc._LIBC[0].calls, 0)
        self.assertEqual(len(self.fsynced), 1)
        self.assertEqual(tc.file_system_type("/proc"), "proc")
        self.assertFalse(tc.syncfs_trusted("/proc"))

    @unittest.skipUnless(LINUX, "syncfs is Linux only")
    def test_much_other_unwritten_data_keeps_the_fsyncs(self):
        tc._LIBC[:] = [FakeLibc(0)]
        tc._SYNCFS_TRUST[os.path.join(self.tmp, "payload")] = True
        tc.unwritten_bytes = lambda: 500 * 1024 * 1024
        self.store_with_pending().flush_with([])
        self.assertEqual(tc._LIBC[0].calls, 0)
        self.assertEqual(len(self.fsynced), 1)


class OpenOverTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tc-over-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    @unittest.skipUnless(hasattr(os, "fchmod"), "needs fchmod")
    @unittest.skipUnless(support.keeps_mode_bits(), "needs chmod to set permission bits "
                                                    "(Windows keeps only a read-only flag)")
    def test_a_wider_file_is_narrowed_before_anything_is_written(self):
        path = os.path.join(self.tmp, "secret")
        with open(path, "wb") as fh:
            fh.write(b"public text that was here before\n")
        os.chmod(path, 0o644)
        out, before = tc.open_over(path, 0o600)
        with out:
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
            self.assertEqual(stat.S_IMODE(before.st_mode), 0o600)
            out.write(b"key")
            after = tc.end_over(out, path, before, 0o600)
        self.assertEqual(after.st_size, 3)
        with open(path, "rb") as fh:
            self.assertEqual(fh.read(), b"key")

    @unittest.skipUnless(hasattr(os, "fchmod"), "needs fchmod")
    @unittest.skipUnless(support.keeps_mode_bits(), "needs chmod to set permission bits "
                                                    "(Windows keeps only a read-only flag)")
    def test_a_narrower_file_is_widened_only_after_writing(self):
        path = os.path.join(self.tmp, "script")
        with open(path, "wb") as fh:
            fh.write(b"old\n")
        os.chmod(path, 0o600)
        out, before = tc.open_over(path, 0o755)
        with out:
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
            out.write(b"#!/bin/sh\n")
            tc.end_over(out, path, before, 0o755)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o755)


if __name__ == "__main__":
    unittest.main()


class CopyDescriptorTest(unittest.TestCase):
    """copy_descriptor: the kernel's copy where it works, a plain copy where not."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tc-copy-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def copy(self, src_path):
        dest = os.path.join(self.tmp, "dest")
        binary = getattr(os, "O_BINARY", 0)  # Windows: no newline or Ctrl-Z translation
        src = os.open(src_path, os.O_RDONLY | binary)
        try:
            dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | binary, 0o600)
            try:
                count = tc.copy_descriptor(src, dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        with open(dest, "rb") as fh:
            return count, fh.read()

    def test_regular_files_of_every_size(self):
        for size in (0, 1, 4096, 3 * tc.CHUNK + 17, 9 * tc.CHUNK):
            data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
            path = os.path.join(self.tmp, "src-%d" % size)
            with open(path, "wb") as fh:
                fh.write(data)
            self.assertEqual(self.copy(path), (size, data), size)

    @unittest.skipUnless(os.path.exists("/proc/version"), "needs /proc")
    def test_a_file_the_kernel_will_not_copy(self):
        # copy_file_range refuses procfs (or copies nothing on older kernels).
        with open("/proc/version", "rb") as fh:
            expected = fh.read()
        self.assertEqual(self.copy("/proc/version"), (len(expected), expected))
