"""Diffs through a real server: tc_show with index and diff: true (what a
step changed against the step before it).

A patch must be exactly what Python's difflib gives for the same two
contents; what has no patch says why; long patches and long diffs stay
within the result's size budget, and omitted.diff counts what was left out.
"""

import difflib
import os

from support import ToolsTest


def expected_patch(path, old, new):
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "a/" + path, "b/" + path, n=3))


def counted(patch, sign):
    return sum(1 for line in patch.splitlines()[2:] if line.startswith(sign))


class DiffTest(ToolsTest):

    def by_path(self, entries):
        return {entry["path"]: entry for entry in entries}


class ShowDiff(DiffTest):

    def test_what_each_step_changed(self):
        self.write("a.txt", "a at the start\n")
        self.write(".env", "TOKEN=1\n")
        self.init(name="show diff")
        self.write("a.txt", "a at step 1\n")
        self.write("b.txt", "b made at step 1\n")
        self.save("one")
        os.remove(os.path.join(self.root, "b.txt"))
        self.write(".env", "TOKEN=22\n")
        self.save("two")
        first = self.ok("tc_show", root=self.root, index=1, diff=True)["diff"]
        self.assertEqual([(e["path"], e["change"]) for e in first],
                         [("a.txt", "replace"), ("b.txt", "write")])
        self.assertEqual(first[0]["patch"],
                         expected_patch("a.txt", "a at the start\n", "a at step 1\n"))
        second = self.by_path(self.ok("tc_show", root=self.root, index=2, diff=True)["diff"])
        self.assertEqual(second["b.txt"]["change"], "delete")
        self.assertEqual(second["b.txt"]["patch"],
                         expected_patch("b.txt", "b made at step 1\n", ""))
        self.assertEqual((second[".env"]["patch"], second[".env"]["reason"]),
                         (None, "sensitive"))
        self.assertNotIn("diff", self.ok("tc_show", root=self.root, index=2))
        res = self.refused("tc_show", root=self.root, diff=True)
        self.assertIn("index", res.text)


if __name__ == "__main__":
    import unittest
    unittest.main()
