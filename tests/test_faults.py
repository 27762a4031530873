"""Faults of the disk under a real server: a full file system.

Needs root to mount a small tmpfs; skipped otherwise.
"""

import os
import shutil
import subprocess
import tempfile
import unittest

from support import Server, write


def mount_tmpfs(path, size):
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s" % size, "tmpfs", path],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc.returncode == 0


class FullDiskTest(unittest.TestCase):

    def setUp(self):
        self.mount = os.path.realpath(tempfile.mkdtemp(prefix="tc-full-"))
        if not mount_tmpfs(self.mount, "2m"):
            os.rmdir(self.mount)
            self.skipTest("mounting a small tmpfs needs root")
        self.addCleanup(os.rmdir, self.mount)
        self.addCleanup(subprocess.run, ["umount", self.mount])
        self.root = os.path.join(self.mount, "ws")
        os.makedirs(self.root)
        self.srv = Server()
        self.srv.initialize()
        self.addCleanup(self.srv.close)

    def fill(self):
        with self.assertRaises(OSError):
            with open(os.path.join(self.root, "filler.bin"), "wb") as fh:
                while True:
                    fh.write(b"x" * 65536)

    def test_full_disk_fails_clearly_and_loses_nothing(self):
        write(self.root, "a.txt", "one\n")
        self.srv.ok("tc_init", root=self.root, name="full")
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="one")["index"], 1)
        self.fill()
        for name, args in (("tc_save", {"title": "two"}), ("tc_capture", {}),
                           ("tc_restore", {"index": 1, "apply": True})):
            res = self.srv.call(name, root=self.root, **args)
            self.assertTrue(res.is_error, "%s on a full disk: %r" % (name, res))
            self.assertIn("No space left", res.text)
            self.assertNotIn("Traceback", res.text)
        os.remove(os.path.join(self.root, "filler.bin"))
        health = self.srv.ok("tc_resume", root=self.root)["health"]
        self.assertTrue(health["ok"], health)
        write(self.root, "a.txt", "two\n")
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="two")["index"], 2)
        self.srv.ok("tc_restore", root=self.root, index=1, apply=True)
        with open(os.path.join(self.root, "a.txt"), "rb") as fh:
            self.assertEqual(fh.read(), b"one\n")


    def test_a_store_that_fills_up_gives_its_space_back(self):
        # The workspace is elsewhere; only the store is on the small disk.
        self.root = os.path.join(os.path.dirname(self.mount), os.path.basename(self.mount) + "-ws")
        os.makedirs(self.root)
        self.addCleanup(shutil.rmtree, self.root, True)
        for n in range(30):
            write(self.root, "f%02d.bin" % n, os.urandom(50_000).hex())  # 3 MB in all
        srv = Server(env={"TC_STORE": os.path.join(self.mount, "store")})
        srv.initialize()
        self.addCleanup(srv.close)
        res = srv.call("tc_init", root=self.root, name="full")
        self.assertTrue(res.is_error, res)
        self.assertIn("No space left", res.text)
        payloads = os.path.join(self.mount, "store", "payload")
        left = [name for _dir, _dirs, names in os.walk(payloads) for name in names]
        self.assertEqual(left, [], "the failed init kept the content it had stored")
        for n in range(15, 30):
            os.remove(os.path.join(self.root, "f%02d.bin" % n))
        srv.ok("tc_init", root=self.root, name="fits")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="one")["index"], 1)


if __name__ == "__main__":
    unittest.main()
