"""What the core does differently where files behave as on Windows.

There a file that another process has open, or that is read-only, can be
neither replaced nor deleted; a file is flushed only through a handle that
may write to it; and permission bits are a read-only flag. These tests set
tc.WINDOWS on a POSIX machine, so they check the decisions the core makes,
not Windows itself (the CI's Windows runner runs the rest of the suite).
"""

import errno
import os
import shutil
import stat
import sys
import tempfile
import unittest

import support

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


@unittest.skipIf(os.name == "nt", "checks the Windows decisions from a POSIX machine")
class WindowsDecisionsTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tc-windows-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        windows, tc.WINDOWS = tc.WINDOWS, True
        self.addCleanup(setattr, tc, "WINDOWS", windows)

    def file(self, name, data=b"data\n", mode=0o644):
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as fh:
            fh.write(data)
        os.chmod(path, mode)
        return path

    def test_a_file_is_flushed_through_a_handle_that_may_write(self):
        import fcntl  # POSIX only, as is this test
        path = self.file("record.json")
        fd = tc.open_to_flush(path)
        try:
            self.assertEqual(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE, os.O_RDWR)
        finally:
            os.close(fd)
        tc.fsync_path(path, strict=True)

    def test_a_file_about_to_go_loses_its_read_only_flag_first(self):
        path = self.file("locked.txt", mode=0o444)
        tc.writable_to_remove(path)
        self.assertTrue(os.stat(path).st_mode & stat.S_IWRITE)
        tc.WINDOWS = False
        other = self.file("kept.txt", mode=0o444)
        tc.writable_to_remove(other)
        self.assertEqual(stat.S_IMODE(os.stat(other).st_mode), 0o444)

    def test_a_record_held_open_by_a_reader_is_replaced_once_it_is_let_go(self):
        target = self.file("state.json", b"old")
        staged = self.file(".tmp-state.part", b"new")
        real, refusals = os.replace, []

        def busy_twice(src, dst, **kwargs):
            if len(refusals) < 2:
                refusals.append(dst)
                raise PermissionError(errno.EACCES, "in use by another process", dst)
            return real(src, dst, **kwargs)

        os.replace = busy_twice
        try:
            tc.replace_record(staged, target)
        finally:
            os.replace = real
        self.assertEqual(refusals, [target, target])
        with open(target, "rb") as fh:
            self.assertEqual(fh.read(), b"new")

    def test_a_mode_is_compared_by_its_write_bit(self):
        bits, tc.MODE_BITS_COMPARED = tc.MODE_BITS_COMPARED, 0o200
        self.addCleanup(setattr, tc, "MODE_BITS_COMPARED", bits)
        recorded_on_linux = tc.manifest_entry(tc.KIND_FILE, "a" * 64, 5, 0o755)
        self.assertTrue(tc.same_content(tc.manifest_entry(tc.KIND_FILE, "a" * 64, 5, 0o666),
                                        recorded_on_linux))
        self.assertFalse(tc.same_content(tc.manifest_entry(tc.KIND_FILE, "a" * 64, 5, 0o444),
                                         recorded_on_linux))


if __name__ == "__main__":
    unittest.main()
