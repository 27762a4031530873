"""The checkpoint store: where it is, how a workspace finds it again, and
what a damaged record in it does.

A task's records live in the workspace's .checkpoints folder unless tc_init
is given a store or the server has TC_STORE; a store outside the workspace
is found again through the pointer file .task-checkpoint-store.json that
tc_init writes into the workspace. A workspace keeps its tasks in one store,
and workspaces sharing a store each see only their own. A damaged record is
named, in the error or in health, and hides none of the records around it.
"""

import json
import os
import shutil
import sys
import unittest

import support
from support import (SCRIPTS, Server, ToolsTest, WorkspaceTest, file_bytes, head_index, read,
                     snapshot, tree_listing, write)

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402


class StoreArgumentTest(ToolsTest):
    """tc_init's store argument and TC_STORE, each result checked against the contract."""

    def test_external_store(self):
        ext = os.path.join(self.tmp, "ext-store")
        res = self.init(store=ext)
        self.assertEqual(os.path.realpath(res["store"]), ext)
        self.assertIs(res["store_is_external"], True)
        with open(os.path.join(self.root, ".task-checkpoint-store.json"), encoding="utf-8") as fh:
            pointer = json.load(fh)
        self.assertEqual(os.path.realpath(pointer["store"]), ext)
        self.assertFalse(os.path.exists(self.store))
        self.write("a.txt", "x\n")
        saved = self.save("one")
        self.assertEqual(self.step_files(res["task_id"], ext), ["s0001.json"])
        # A new server process finds the store through the pointer.
        other = self.server()
        resumed = self.ok("tc_resume", srv=other, root=self.root)
        self.assertEqual(head_index(resumed["head"]), saved["index"])
        self.assertEqual(os.path.realpath(resumed["store"]), ext)

    def test_a_task_in_another_store_than_the_workspace_tasks_is_refused(self):
        first = self.init(name="first")["task_id"]
        self.save("first step", next="go on with first")
        second = self.init(name="second")["task_id"]  # suspends first, same store
        ext = os.path.join(self.tmp, "ext-store")
        res = self.refused("tc_init", root=self.root, name="third", store=ext)
        self.assertIn("tasks %r, %r are kept in %r" % tuple(sorted([first, second]) + [self.store]),
                      res.text)
        self.assertFalse(os.path.exists(ext))
        self.assertFalse(os.path.exists(os.path.join(self.root, ".task-checkpoint-store.json")))
        self.assertEqual(self.ok("tc_resume", root=self.root)["active_task"], second)
        self.ok("tc_switch", root=self.root, task_id=first)
        self.assertEqual(self.ok("tc_resume", root=self.root)["next"], "go on with first")
        # A workspace whose tasks are in an external store: the same holds.
        other = os.path.join(self.tmp, "other-ws")
        write(other, "a.txt", "a\n")
        kept = self.ok("tc_init", root=other, name="kept", store=ext)["task_id"]
        res = self.refused("tc_init", root=other, name="next",
                           store=os.path.join(self.tmp, "ext-two"))
        self.assertIn("task %r is kept in %r" % (kept, ext), res.text)
        # The way out named is the workspace's pointer, not the shared store.
        self.assertIn("delete %r" % os.path.join(other, ".task-checkpoint-store.json"), res.text)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "ext-two")))
        # The same store again is fine, and so is a store holding only
        # other workspaces' tasks.
        self.assertEqual(self.ok("tc_init", root=other, name="here too", store=ext)[
            "prev_suspended"], kept)
        third = os.path.join(self.tmp, "third-ws")
        write(third, "b.txt", "b\n")
        self.assertTrue(self.ok("tc_init", root=third, name="third", store=ext)[
            "store_is_external"])

    def test_tc_store_naming_another_store_than_the_workspace_tasks_is_refused(self):
        mine = self.init(name="mine")["task_id"]
        elsewhere = os.path.join(self.tmp, "env-store")
        other = Server(env={"TC_STORE": elsewhere})
        self.addCleanup(other.close)
        other.initialize()
        for arguments in ({}, {"store": elsewhere}):
            res = self.refused("tc_init", srv=other, root=self.root, name="theirs", **arguments)
            self.assertIn("task %r is kept in %r" % (mine, self.store), res.text)
            self.assertIn("TC_STORE" if not arguments else "Leave out store", res.text)
        self.assertFalse(os.path.exists(elsewhere))
        self.assertFalse(os.path.exists(os.path.join(self.root, ".task-checkpoint-store.json")))
        self.assertEqual(self.ok("tc_resume", root=self.root)["task_id"], mine)

    def test_a_damaged_task_of_the_workspace_counts_as_its_own(self):
        mine = self.init(name="mine")["task_id"]
        state = os.path.join(self.task_dir(mine), "state.json")
        with open(state, "r+b") as fh:
            fh.truncate(10)  # torn: no workspace can be read from it
        res = self.refused("tc_init", root=self.root, name="next",
                           store=os.path.join(self.tmp, "ext"))
        self.assertIn("%r (damaged) is kept in" % mine, res.text)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "ext")))

    def test_the_way_out_named_for_a_linked_store_folder_is_that_folder(self):
        elsewhere = os.path.join(self.tmp, "linked-store")
        os.makedirs(elsewhere)
        os.symlink(elsewhere, os.path.join(self.root, ".checkpoints"))
        mine = self.init(name="mine")["task_id"]
        pointer = os.path.join(self.root, ".task-checkpoint-store.json")
        self.assertTrue(os.path.isfile(pointer))  # the store lies outside, behind the link
        # Both the pointer and the link lead to the store: both ways out are named.
        res = self.refused("tc_init", root=self.root, name="next",
                           store=os.path.join(self.tmp, "ext"))
        self.assertIn("delete %r" % pointer, res.text)
        self.assertIn("move %r aside" % os.path.join(self.root, ".checkpoints"), res.text)
        os.remove(pointer)  # the link alone leads to the same store
        res = self.refused("tc_init", root=self.root, name="next",
                           store=os.path.join(self.tmp, "ext"))
        self.assertIn(mine, res.text)
        self.assertIn("move %r aside" % os.path.join(self.root, ".checkpoints"), res.text)
        self.assertNotIn(".task-checkpoint-store.json", res.text)
        # A pointer file that is a link is not read, so it is no way out either.
        target = os.path.join(self.tmp, "pointer-elsewhere.json")
        with open(target, "w") as fh:
            json.dump({"store": os.path.join(self.tmp, "ext")}, fh)
        os.symlink(target, pointer)
        res = self.refused("tc_init", root=self.root, name="next",
                           store=os.path.join(self.tmp, "ext"))
        self.assertIn("move %r aside" % os.path.join(self.root, ".checkpoints"), res.text)
        # Doing so, the new task goes to the store asked for, and stays found:
        # the link is replaced by a pointer file.
        os.rename(os.path.join(self.root, ".checkpoints"), os.path.join(self.tmp, "aside"))
        after = self.init(name="next", store=os.path.join(self.tmp, "ext"))["task_id"]
        self.assertFalse(os.path.islink(pointer))
        self.assertEqual(self.ok("tc_resume", root=self.root)["task_id"], after)
        fresh = Server()
        self.addCleanup(fresh.close)
        fresh.initialize()
        self.assertEqual(fresh.ok("tc_resume", root=self.root)["task_id"], after)

    def test_a_store_folder_holding_only_a_gitignore_counts_as_empty(self):
        ext = os.path.join(self.tmp, "ext-store")
        os.makedirs(ext)
        with open(os.path.join(ext, ".gitignore"), "w") as fh:
            fh.write("*\n")
        self.assertIs(self.init(store=ext)["store_is_external"], True)
        with open(os.path.join(ext, ".gitignore")) as fh:
            self.assertEqual(fh.read(), "*\n")  # the user's file is kept
        shutil.rmtree(ext)  # its task is not wanted: another store may take the workspace
        cleared = os.path.join(self.tmp, "cleared-store")
        self.init(store=cleared)
        for name in os.listdir(cleared):  # what `rm -rf store/*` leaves: the dot file
            if not name.startswith("."):
                path = os.path.join(cleared, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        self.assertEqual(os.listdir(cleared), [".gitignore"])
        self.init(name="again", store=cleared)
        other = os.path.join(self.tmp, "other-files")
        os.makedirs(other)
        with open(os.path.join(other, "notes.txt"), "w") as fh:
            fh.write("mine\n")
        self.refused("tc_init", root=self.root, name="x", store=other)

    def test_a_project_with_a_tasks_folder_is_not_taken_for_a_store(self):
        project = os.path.join(self.tmp, "project")
        write(project, "README.md", "mine\n")
        write(project, "tasks/todo.md", "- one\n")
        before = snapshot(project, skip=())
        res = self.refused("tc_init", root=self.root, name="x", store=project)
        self.assertIn("other files", res.text)
        self.assertEqual(snapshot(project, skip=()), before)
        # A store a first init left partway (its lock and tasks folder) is one.
        partway = os.path.join(self.tmp, "partway")
        os.makedirs(os.path.join(partway, "tasks"))
        write(partway, "state.lock", "")
        write(partway, ".tmp-0123456789ab.part", "{")  # a write the kill cut short
        self.assertIs(self.init(store=partway)["store_is_external"], True)

    def test_store_from_the_environment(self):
        env_store = os.path.join(self.tmp, "env-store")
        srv = self.server(env={"TC_STORE": env_store})
        res = self.ok("tc_init", srv=srv, root=self.root, name="env")
        self.assertEqual(os.path.realpath(res["store"]), env_store)
        self.assertIs(res["store_is_external"], True)
        self.assertTrue(os.path.isdir(os.path.join(env_store, "tasks", res["task_id"])))
        self.assertFalse(os.path.exists(self.store))

    def test_relative_store_is_refused(self):
        cwd = os.path.join(self.tmp, "cwd")
        os.makedirs(cwd)
        before = tree_listing(self.tmp)
        self.refused("tc_init", root=self.root, name="x", store="rel-store")
        srv = self.server(env={"TC_STORE": "rel-store"}, cwd=cwd)
        self.refused("tc_init", srv=srv, root=self.root, name="x")
        self.assertEqual(tree_listing(self.tmp), before)

    def test_workspaces_sharing_a_store_stay_apart(self):
        shared = os.path.join(self.tmp, "shared-store")
        other = os.path.join(self.tmp, "ws2")
        os.makedirs(other)
        self.write("one.txt", "1\n")
        with open(os.path.join(other, "two.txt"), "w") as fh:
            fh.write("2\n")
        a = self.init(name="A", goal="goal A", store=shared)["task_id"]
        self.save("a1")
        b = self.ok("tc_init", root=other, name="B", goal="goal B", store=shared)["task_id"]
        self.assertNotEqual(a, b)
        # A new task here suspends this workspace's task, never the other's.
        self.assertEqual(self.init(name="A2", store=shared)["prev_suspended"], a)
        self.ok("tc_switch", root=self.root, task_id=a)
        self.assertEqual(self.ok("tc_resume", root=self.root)["goal"], "goal A")
        self.assertEqual(self.ok("tc_resume", root=other)["goal"], "goal B")
        before = [p for p in tree_listing(shared) if p[0] != "server.log"]
        self.refused("tc_switch", root=other, task_id=a)
        self.refused("tc_save", root=other, title="wrong place", task_id=a)
        self.assertEqual([p for p in tree_listing(shared) if p[0] != "server.log"], before)
        self.assertEqual(self.ok("tc_resume", root=other)["active_task"], b)

    def test_store_equal_to_root_is_refused(self):
        for store in (self.root, self.root + "/", os.path.join(self.root, "..", "ws")):
            with self.subTest(store=store):
                before = tree_listing(self.tmp)
                self.refused("tc_init", root=self.root, name="x", store=store)
                self.assertEqual(tree_listing(self.tmp), before)


class ExternalStoreTest(WorkspaceTest):
    """External stores, the pointer file, and workspaces sharing one store."""

    server_env = {"TC_WATCH": "off"}

    def two_workspaces(self):
        w1 = os.path.join(self.tmp, "w1")
        w2 = os.path.join(self.tmp, "w2")
        for root, tag in ((w1, "w1"), (w2, "w2")):
            os.makedirs(os.path.join(root, "src"))
            for rel, data in (("%s_only.txt" % tag, tag), ("common.txt", "common " + tag),
                              ("src/%s_code.py" % tag, "x = '%s'\n" % tag)):
                with open(os.path.join(root, *rel.split("/")), "w") as fh:
                    fh.write(data)
        return w1, w2

    def check_isolated(self, srv, w1, w2, store):
        t1 = srv.ok("tc_init", root=w1, name="first", goal="goal one")["task_id"]
        t2 = srv.ok("tc_init", root=w2, name="second", goal="goal two")["task_id"]
        srv.ok("tc_save", root=w1, title="w1 step", conclusion="c1", next="n1")
        srv.ok("tc_save", root=w2, title="w2 step", conclusion="c2", next="n2")
        s1, s2 = file_bytes(w1), file_bytes(w2)
        for root in (w1, w2):
            self.assertFalse(os.path.exists(os.path.join(root, ".checkpoints")))
            with open(os.path.join(root, ".task-checkpoint-store.json")) as fh:
                pointer = json.load(fh)
            self.assertEqual(os.path.realpath(pointer["store"]), os.path.realpath(store))
        self.assertTrue(os.path.isdir(os.path.join(store, "tasks", t1)))
        self.assertTrue(os.path.isdir(os.path.join(store, "tasks", t2)))

        with open(os.path.join(w1, "w1_late.txt"), "w") as fh:
            fh.write("late w1\n")
        with open(os.path.join(w1, "common.txt"), "w") as fh:
            fh.write("common w1, edited\n")
        r1 = srv.ok("tc_resume", root=w1)
        r2 = srv.ok("tc_resume", root=w2)
        self.assertEqual((r1["goal"], r2["goal"]), ("goal one", "goal two"))
        self.assertEqual(r2["drift_paths"], [], r2)
        self.assertIn("w1_late.txt", json.dumps(r1["drift_paths"]))
        self.assertNotIn("w2", json.dumps(r1["drift_paths"]))
        self.assertFalse(srv.ok("tc_capture", root=w2)["captured"])
        self.assertTrue(srv.ok("tc_capture", root=w1)["captured"])
        srv.ok("tc_save", root=w1, title="w1 second", conclusion="c", next="n")
        for root, foreign in ((w1, "w2_"), (w2, "w1_")):
            shown = srv.ok("tc_show", root=root, include_drift=True, limit=200)
            self.assertNotIn(foreign, json.dumps(shown), root)
            self.assertNotIn(foreign, json.dumps(srv.ok("tc_resume", root=root)), root)
            plan = srv.ok("tc_restore", root=root, index=1, apply=False)["plan"]
            self.assertNotIn(foreign, json.dumps(plan), root)
        srv.ok("tc_restore", root=w1, index=1, apply=True)
        srv.ok("tc_restore", root=w2, index=1, apply=True)
        self.assertEqual(file_bytes(w1), s1)
        self.assertEqual(file_bytes(w2), s2)
        return t1, t2

    def test_workspaces_sharing_store_via_env_stay_isolated(self):
        store = os.path.join(self.tmp, "shared-store")
        w1, w2 = self.two_workspaces()
        srv = self.server(env={"TC_STORE": store})
        self.check_isolated(srv, w1, w2, store)

    def test_workspaces_sharing_store_via_init_argument_stay_isolated(self):
        store = os.path.join(self.other_dir("tc-store-"), "store")
        w1, w2 = self.two_workspaces()
        srv = self.server()
        t1 = srv.ok("tc_init", root=w1, name="first", goal="goal one", store=store)
        self.assertTrue(t1["store_is_external"], t1)
        srv.ok("tc_init", root=w2, name="second", goal="goal two", store=store)
        self.check_isolated(srv, w1, w2, store)

    def test_new_server_without_env_finds_store_through_pointer(self):
        store = os.path.join(self.other_dir("tc-store-"), "store")
        first = self.server(env={"TC_STORE": store})
        self.write("a.txt", "a\n")
        init = first.ok("tc_init", root=self.root, name="pointer", goal="pointer goal")
        self.assertTrue(init["store_is_external"], init)
        first.ok("tc_save", root=self.root, title="one", conclusion="c", next="pointer next")
        first.close()
        with open(os.path.join(self.root, ".task-checkpoint-store.json")) as fh:
            self.assertEqual(os.path.realpath(json.load(fh)["store"]), os.path.realpath(store))

        second = self.server()  # no TC_STORE in its environment
        self.assertNotIn("TC_STORE", second.env)
        resume = second.ok("tc_resume", root=self.root)
        self.assertEqual((resume["goal"], resume["next"]), ("pointer goal", "pointer next"))
        self.write("a.txt", "a, second step\n")
        self.assertEqual(second.ok("tc_save", root=self.root, title="two")["index"], 2)
        self.assertTrue(os.path.isfile(os.path.join(
            store, "tasks", init["task_id"], "steps", "s0002.json")))
        self.assertFalse(os.path.exists(os.path.join(self.root, ".checkpoints")))

    def test_a_tc_store_elsewhere_says_where_the_workspaces_tasks_are(self):
        self.write("a.txt", "a\n")
        srv = self.server()
        task = srv.ok("tc_init", root=self.root, name="own store")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        other = os.path.join(self.other_dir("tc-store-"), "store")
        elsewhere = self.server(env={"TC_STORE": other})
        for tool, args in (("tc_resume", {}), ("tc_save", {"title": "two"})):
            res = elsewhere.call(tool, root=self.root, **args)
            self.assertTrue(res.is_error, res)
            self.assertIn(task, res.text)
            self.assertIn(os.path.join(self.root, ".checkpoints"), res.text)
            self.assertIn("unset TC_STORE", res.text)
        self.assertFalse(os.path.exists(other))

    def test_store_equal_to_root_is_refused(self):
        self.write("a.txt", "a\n")
        srv = self.server()
        before = tree_listing(self.root)
        for store in (self.root, self.root + "/", os.path.join(self.root, "sub", "..")):
            res = srv.call("tc_init", root=self.root, name="same", goal="g", store=store)
            self.assertTrue(res.is_error, (store, res))
            self.assertEqual(tree_listing(self.root), before, store)
        env_srv = self.server(env={"TC_STORE": self.root})
        res = env_srv.call("tc_init", root=self.root, name="same", goal="g")
        self.assertTrue(res.is_error, res)
        self.assertEqual(tree_listing(self.root), before)

    def test_store_inside_workspace_is_never_scanned(self):
        self.write("a.txt", "a\n")
        srv = self.server()
        inner = os.path.join(self.root, "inner-store")
        srv.ok("tc_init", root=self.root, name="inner", goal="g", store=inner)
        srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        self.write("a.txt", "a2\n")
        srv.ok("tc_save", root=self.root, title="two", conclusion="c", next="n")
        self.assertFalse(srv.ok("tc_capture", root=self.root)["captured"])
        shown = srv.ok("tc_show", root=self.root, include_drift=True, limit=200)
        self.assertNotIn("inner-store", json.dumps(shown))
        resume = srv.ok("tc_resume", root=self.root)
        resume.pop("store")  # the one field that names the store on purpose
        self.assertNotIn("inner-store", json.dumps(resume))
        plan = srv.ok("tc_restore", root=self.root, index=1, apply=False)["plan"]
        self.assertNotIn("inner-store", json.dumps(plan))

    def test_default_store_init_after_external_store(self):
        srv = self.server()
        self.write("a.txt", "1\n")
        ext = os.path.join(self.tmp, "ext")
        one = srv.ok("tc_init", root=self.root, name="one", store=ext)["task_id"]
        # The workspace names one store: a task elsewhere would leave "one"
        # out of reach, so that is refused, naming it.
        res = srv.call("tc_init", root=self.root, name="two", store=self.store)
        self.assertTrue(res.is_error, res)
        self.assertIn(one, res.text)
        self.assertIn(ext, res.text)
        self.assertFalse(os.path.exists(self.store))
        self.assertEqual(srv.ok("tc_save", root=self.root, title="step")["task_id"], one)
        # With that store moved aside, the default store takes the workspace.
        shutil.move(ext, ext + "-old")
        two = srv.ok("tc_init", root=self.root, name="two", store=self.store)
        saved = srv.ok("tc_save", root=self.root, title="step")
        self.assertEqual(saved["task_id"], two["task_id"])

    def test_store_argument_wins_or_is_refused_when_tc_store_is_set(self):
        srv = self.server(env={"TC_STORE": os.path.join(self.tmp, "env-store")})
        self.write("a.txt", "1\n")
        res = srv.call("tc_init", root=self.root, name="x",
                       store=os.path.join(self.tmp, "arg-store"))
        if res.is_error:
            return
        saved = srv.call("tc_save", root=self.root, title="step")
        self.assertFalse(saved.is_error, saved.text)
        self.assertEqual(saved["task_id"], res["task_id"])

    def test_pointer_to_the_workspace_root_is_refused(self):
        self.write("a.txt", "1\n")
        with open(os.path.join(self.root, ".task-checkpoint-store.json"), "w") as fh:
            json.dump({"store": self.root}, fh)
        srv = self.server()
        res = srv.call("tc_init", root=self.root, name="t")
        self.assertTrue(res.is_error, res.text)
        self.assertFalse(os.path.exists(os.path.join(self.root, "tasks")))

    def test_compress_keeps_content_another_workspace_still_needs(self):
        store = os.path.join(self.tmp, "shared")
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        srv = self.server(env={"TC_STORE": store})
        write(other, "f.txt", "base\n")
        srv.ok("tc_init", root=other, name="b")
        write(other, "f.txt", "shared content\n")
        kept = srv.ok("tc_capture", root=other)["drift_id"]
        write(other, "f.txt", "later\n")
        srv.ok("tc_capture", root=other)
        self.write("g.txt", "a0\n")
        srv.ok("tc_init", root=self.root, name="a")
        self.write("g.txt", "shared content\n")
        srv.ok("tc_capture", root=self.root)
        self.write("g.txt", "a2\n")
        srv.ok("tc_capture", root=self.root)
        srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0)
        res = srv.call("tc_restore", root=other, drift_id=kept)
        if res.is_error:  # refused as reclaimed is honest too
            self.assertIn("reclaimed", res.text)
            return
        self.assertEqual(res["plan"]["unrestorable"], [],
                         "compress on one workspace destroyed another's drift content")


class StoreOrWorkspaceTest(WorkspaceTest):
    """Which folder may be a store and which a workspace: a store is neither a
    workspace nor an export's destination, a project that looks like a store
    is still a workspace, a folder given as the store loses none of its
    files, and a kernel file system is no workspace."""

    def test_a_project_that_merely_resembles_a_store_is_a_workspace(self):
        # A tasks/ folder and a state.lock file are ordinary project content.
        self.write("tasks/build.py", "print('build')\n")
        self.write("state.lock", "")
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="lookalike")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="one")["index"], 1)

    def test_a_store_is_refused_as_a_workspace(self):
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="outer")
        res = srv.call("tc_init", root=self.store, name="inner")
        self.assertTrue(res.is_error, res)
        self.assertIn("inside the checkpoint store", res.text)

    def test_an_export_into_a_store_is_refused(self):
        self.write("a.txt", "one\n")
        srv = self.server()
        task_id = srv.ok("tc_init", root=self.root, name="exported")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        external = os.path.join(self.tmp, "shared-store")
        other = os.path.join(self.tmp, "other")
        write(other, "b.txt", "b\n")
        srv.ok("tc_init", root=other, name="elsewhere", store=external)
        for to in (self.store, os.path.join(self.store, "tasks"),
                   os.path.join(self.store, "payload"), external,
                   os.path.join(external, "tasks")):
            with self.subTest(to=to):
                res = srv.call("tc_export", root=self.root, to=to)
                self.assertTrue(res.is_error, res)
                self.assertIn("inside the checkpoint store", res.text)
                self.assertFalse(os.path.exists(os.path.join(to, task_id + "-handoff")))
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        self.assertTrue(srv.ok("tc_export", root=self.root, to=out)["path"].startswith(out))

    def test_kernel_pseudo_file_systems_are_refused_as_workspaces(self):
        srv = self.server()
        for root in ("/proc", "/sys", "/dev"):
            if not os.path.isdir(root) or tc.file_system_type(root) not in \
                    tc.PSEUDO_FILE_SYSTEMS:
                continue
            with self.subTest(root=root):
                existed = os.path.exists(os.path.join(root, ".checkpoints"))
                res = srv.call("tc_init", root=root, name="kernel")
                self.assertTrue(res.is_error, res)
                self.assertIn("file system", res.text)
                self.assertEqual(os.path.exists(os.path.join(root, ".checkpoints")), existed)

    def test_store_argument_never_deletes_files_already_there(self):
        notes = os.path.join(self.tmp, "notes")
        write(notes, "writing", "my novel, chapter 1\n")
        write(notes, "drafts/.tmp-idea.txt", "an idea\n")
        self.write("a.txt", "1\n")
        srv = self.server()
        srv.call("tc_init", root=self.root, name="t", store=notes)
        for rel, data in (("writing", b"my novel, chapter 1\n"),
                          ("drafts/.tmp-idea.txt", b"an idea\n")):
            self.assertTrue(os.path.isfile(os.path.join(notes, *rel.split("/"))),
                            "tc_init deleted %s from the directory given as store" % rel)
            self.assertEqual(read(notes, rel), data)


class DamagedRecordTest(WorkspaceTest):
    """A damaged or half-made record is named in the error, never an internal
    error, and the index, a cache, is read again rather than trusted."""

    def init(self, srv):
        return srv.ok("tc_init", root=self.root, name="damaged")["task_id"]

    def test_a_damaged_record_is_named_not_an_internal_error(self):
        self.write("a.txt", "one\n")
        srv = self.server()
        task_id = srv.ok("tc_init", root=self.root, name="damaged")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "two\n")
        srv.ok("tc_capture", root=self.root)
        srv.ok("tc_save", root=self.root, title="two")
        srv.close()
        task = os.path.join(self.store, "tasks", task_id)

        def edit(rel, change):
            path = os.path.join(self.store, rel)
            with open(path, "rb") as fh:
                doc = json.loads(fh.read())
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(change(doc), fh)

        def manifest_of_step_one(doc):
            table = doc.get("files") or doc.get("changes")
            table[sorted(table)[0]] = ["f", "../../../outside", 4, 420, 0]
            return doc

        step_one = json.loads(read(task, "steps/s0001.json"))
        step_two = json.loads(read(task, "steps/s0002.json"))
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)

        def escaping_path(doc):
            table = doc.get("files") or doc.get("changes")
            table["../../escaped.txt"] = table[sorted(table)[0]] or ["f", "ab" * 32, 1, 420, 0]
            return doc

        cases = [
            ("state.json", lambda d: dict(d, head="two"), "tc_show", {}),
            ("steps/s0002.json", lambda d: [], "tc_show", {"index": 2}),
            ("manifest/m%04d.json" % step_one["manifest"], manifest_of_step_one,
             "tc_restore", {"index": 1}),
            ("drifts/d0002.json", lambda d: dict(d, created_ns=None), "tc_compress",
             {"keep_seconds": 0}),
            ("../../current.json", lambda d: {"format": 1, "active": 42}, "tc_resume", {}),
            ("manifest/m%04d.json" % step_two["manifest"], escaping_path, "tc_export",
             {"to": out}),
        ]
        for rel, change, tool, args in cases:
            with self.subTest(record=rel):
                path = os.path.join(task, rel)
                with open(path, "rb") as fh:
                    good = fh.read()
                edit(os.path.relpath(path, self.store), change)
                srv = self.server()
                res = srv.call(tool, root=self.root, **args)
                self.assertTrue(res.is_error, res)
                self.assertIn(os.path.basename(rel), res.text)
                self.assertNotIn("internal error", res.text)
                with open(path, "wb") as fh:
                    fh.write(good)
                for folder in (self.tmp, out):
                    self.assertFalse(os.path.exists(os.path.join(folder, "escaped.txt")))
                self.assertFalse(srv.call(tool, root=self.root, **args).is_error)
                for name in os.listdir(out):
                    shutil.rmtree(os.path.join(out, name))
                srv.close()
        # The index is only a cache: a damaged row means reading files again.
        rows = json.loads(read(task, "index.json"))
        rows["files"]["b.txt"] = rows["files"]["a.txt"][:7] + ["../a"]
        with open(os.path.join(task, "index.json"), "w", encoding="utf-8") as fh:
            json.dump(rows, fh)
        srv = self.server()
        health = srv.ok("tc_resume", root=self.root)["health"]
        self.assertIn("index", " ".join(health["errors"]))
        self.assertEqual(srv.ok("tc_save", root=self.root, title="three")["index"], 3)
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])

    def test_json_nested_past_the_parser_is_damage_not_an_internal_error(self):
        nested = "[" * 50000 + "]" * 50000
        self.write("a.txt", "one\n")
        srv = self.server()
        task_id = srv.ok("tc_init", root=self.root, name="nested")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = srv.ok("tc_export", root=self.root, to=out)["path"]
        with open(os.path.join(package, "handoff.json"), "w", encoding="utf-8") as fh:
            fh.write(nested)
        fresh = os.path.join(self.tmp, "fresh")
        write(fresh, "b.txt", "b\n")
        res = srv.call("tc_import", root=fresh, package=package)
        self.assertTrue(res.is_error, res)
        self.assertIn("handoff.json", res.text)
        self.assertIn("nested too deeply", res.text)

        state = os.path.join(self.store, "tasks", task_id, "state.json")
        with open(state, "rb") as fh:
            good = fh.read()
        with open(state, "w", encoding="utf-8") as fh:
            fh.write('{"head": %s}' % nested)
        res = srv.call("tc_show", root=self.root)
        self.assertTrue(res.is_error, res)
        self.assertIn("state.json", res.text)
        with open(state, "wb") as fh:
            fh.write(good)

        # Workspace content alone: a repository can carry any pointer file.
        other = os.path.join(self.tmp, "cloned")
        write(other, tc.POINTER_NAME, '{"store": %s}' % nested)
        for tool, args in (("tc_resume", {}), ("tc_init", {"name": "x"})):
            res = srv.call(tool, root=other, **args)
            self.assertTrue(res.is_error, res)
            self.assertIn("store pointer", res.text)
        srv.ok("tc_show", root=self.root)

    def test_half_created_task_does_not_break_compress(self):
        srv = self.server()
        self.write("a.txt", "1\n")
        srv.ok("tc_init", root=self.root, name="t")
        os.makedirs(os.path.join(self.store, "tasks", "half-abc123", "drifts"))
        res = srv.call("tc_compress", root=self.root)
        self.assertFalse(res.is_error, res.text)

    def test_damaged_index_cache_does_not_block_saves(self):
        srv = self.server()
        self.write("a.txt", "1\n")
        task = self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        with open(os.path.join(self.store, "tasks", task, "index.json"), "wb"):
            pass  # what an index written without fsync can be after a power cut
        self.write("a.txt", "2\n")
        res = srv.call("tc_save", root=self.root, title="two")
        self.assertFalse(res.is_error, res.text)


# A file name the atomic writer's temp files would have.
TEMP_NAME = ".tmp-k3j9x1.part"


class DamagedRecordReportTest(ToolsTest):
    """Damaged records named in tc_resume's health and in tc_show."""

    def test_leftover_temp_file_is_reported(self):
        task = self.prepare()
        leftover = os.path.join(self.task_dir(task), TEMP_NAME)
        with open(leftover, "w") as fh:
            fh.write("{half")
        res = self.ok("tc_resume", root=self.root)
        self.assertIs(res["health"]["ok"], False)
        self.assertTrue(any(TEMP_NAME in e for e in map(str, res["health"]["errors"])),
                        res["health"])
        self.assertTrue(os.path.exists(leftover), "resume must not clean up (it is read-only)")

    def test_a_damaged_step_is_reported_once(self):
        task = self.prepare()
        with open(os.path.join(self.task_dir(task), "steps", "s0002.json"), "w") as fh:
            fh.write("[]")  # the current step
        res = self.ok("tc_resume", root=self.root)
        self.assertIs(res["health"]["ok"], False)
        self.assertEqual(len(res["health"]["errors"]), 1, res["health"])
        self.assertIn("s0002.json", res["health"]["errors"][0])

    def test_unparsable_state_is_reported(self):
        task = self.prepare()
        state = os.path.join(self.task_dir(task), "state.json")
        with open(state, "w") as fh:
            fh.write("{this is not json")
        before = tree_listing(self.store)
        res = self.ok("tc_resume", root=self.root)
        self.assertIs(res["health"]["ok"], False)
        self.assertTrue(any("state.json" in e for e in map(str, res["health"]["errors"])),
                        res["health"])
        self.assertEqual([p for p in tree_listing(self.store) if p[0] != "server.log"],
                         [p for p in before if p[0] != "server.log"])

    def test_state_that_parses_but_is_no_state_is_named(self):
        task = self.prepare()
        state = os.path.join(self.task_dir(task), "state.json")
        with open(state, encoding="utf-8") as fh:
            good = json.load(fh)
        for damaged in ([], {}, dict(good, head="three"), {k: v for k, v in good.items()
                                                            if k != "status"}):
            with open(state, "w", encoding="utf-8") as fh:
                json.dump(damaged, fh)
            res = self.ok("tc_resume", root=self.root)
            self.assertIs(res["health"]["ok"], False, damaged)
            self.assertTrue(any("state.json" in e for e in res["health"]["errors"]),
                            (damaged, res["health"]))

    def test_a_damaged_record_does_not_hide_the_others_from_tc_show(self):
        task = self.prepare()
        self.ok("tc_capture", root=self.root)
        self.write("src/b.py", "b = 2\n")
        self.ok("tc_capture", root=self.root)
        with open(os.path.join(self.task_dir(task), "steps", "s0001.json"), "w") as fh:
            fh.write("{cut off")
        with open(os.path.join(self.task_dir(task), "drifts", "d0001.json"), "w") as fh:
            json.dump({"id": "d0001"}, fh)
        res = self.ok("tc_show", root=self.root, include_drift=True)
        self.assertEqual([s["index"] for s in res["steps"]], [1, 2])
        self.assertIn("s0001.json", res["steps"][0]["damaged"])
        self.assertEqual(res["steps"][1]["title"], "Wrote the service layer")
        self.assertNotIn("damaged", res["steps"][1])
        self.assertEqual([d["id"] for d in res["drifts"]][:2], ["d0001", "d0002"])
        self.assertIn("d0001.json", res["drifts"][0]["damaged"])
        self.assertIs(res["drifts"][0]["restorable"], False)
        self.assertNotIn("damaged", res["drifts"][1])
        # Names no record gets are not records; a link to nothing is listed as damaged.
        steps = os.path.join(self.task_dir(task), "steps")
        for stray in ("s00002.json", "s\u0663.json", "s\u00b2.json", "s0000.json"):
            with open(os.path.join(steps, stray), "w") as fh:
                fh.write("{}")
        linked = support.can_symlink()
        if linked:
            os.symlink("nowhere.json", os.path.join(steps, "s0007.json"))
        again = self.ok("tc_show", root=self.root)
        self.assertEqual([s["index"] for s in again["steps"]], [1, 2] + [7] * linked)
        if linked:
            self.assertIn("damaged", again["steps"][2])
        # Asked for by itself, the damaged record is still refused with the reason.
        self.assertIn("s0001.json", self.refused("tc_show", root=self.root, index=1).text)
        self.assertIn("s0001.json", self.refused("tc_restore", root=self.root, index=1).text)

class MovedWorkspaceTest(ToolsTest):
    """A workspace folder moved (mv) or copied (cp -a) with its store inside
    finds its tasks at the new path; an external store says where its tasks
    are and how to continue; a task named by its exact name is found."""

    def start(self):
        task = self.init(goal="keep going")["task_id"]
        self.write("a.txt", "one\n")
        self.save("one", conclusion="first done", next="do two")
        return task

    def test_a_moved_workspace_keeps_its_tasks(self):
        task = self.start()
        moved = os.path.join(self.tmp, "moved")
        os.rename(self.root, moved)
        resumed = self.ok("tc_resume", root=moved)
        self.assertEqual((resumed["task_id"], resumed["head"], resumed["next"]),
                         (task, 1, "do two"))
        self.assertIn("moved or copied", resumed["note"])
        self.assertIn(self.root, resumed["note"])
        write(moved, "a.txt", "two\n")
        self.assertEqual(self.ok("tc_save", root=moved, title="two")["index"], 2)
        self.ok("tc_restore", root=moved, index=1, apply=True)
        self.assertEqual(read(moved, "a.txt"), b"one\n")
        self.assertNotIn("note", self.ok("tc_resume", root=moved), "said once")

    def test_a_copied_workspace_and_its_original_each_go_on(self):
        task = self.start()
        copy = os.path.join(self.tmp, "copy")
        shutil.copytree(self.root, copy, symlinks=True)
        self.assertEqual(self.ok("tc_resume", root=copy)["task_id"], task)
        write(copy, "a.txt", "copy\n")
        self.ok("tc_save", root=copy, title="in the copy")
        self.assertEqual(self.ok("tc_resume", root=self.root)["head"], 1)
        self.write("a.txt", "original\n")
        self.assertEqual(self.save("in the original")["index"], 2)
        self.assertEqual(read(copy, "a.txt"), b"copy\n")

    def test_an_external_store_names_the_tasks_of_the_old_path_and_switch_takes_one_over(self):
        ext = os.path.join(self.tmp, "ext")
        task = self.init(store=ext)["task_id"]
        self.write("a.txt", "one\n")
        self.save("one")
        moved = os.path.join(self.tmp, "moved")
        os.rename(self.root, moved)
        refused = self.refused("tc_resume", root=moved)
        self.assertIn(task, refused.text)
        self.assertIn(self.root, refused.text)
        self.assertIn("tc_switch", refused.text)
        switched = self.ok("tc_switch", root=moved, task_id=task)
        self.assertIn("no longer there", switched["note"])
        self.assertEqual(self.ok("tc_resume", root=moved)["task_id"], task)
        write(moved, "a.txt", "two\n")
        self.assertEqual(self.ok("tc_save", root=moved, title="two")["index"], 2)

    def test_a_task_of_a_workspace_still_there_is_not_taken_over(self):
        ext = os.path.join(self.tmp, "ext")
        task = self.init(store=ext)["task_id"]
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        self.ok("tc_init", root=other, name="other", store=ext)
        refused = self.refused("tc_switch", root=other, task_id=task)
        self.assertIn("tc_export", refused.text)
        self.assertEqual(self.ok("tc_resume", root=self.root)["task_id"], task)

    def test_a_task_is_found_by_its_exact_name_and_an_unknown_one_lists_the_ids(self):
        first = self.init(name="alpha work")["task_id"]
        second = self.init(name="beta work")["task_id"]
        self.assertEqual(self.ok("tc_switch", root=self.root, task_id="alpha work")["task_id"],
                         first)
        self.assertEqual(self.ok("tc_show", root=self.root, task_id="beta work")["task_id"],
                         second)
        refused = self.refused("tc_resume", root=self.root, task_id="gamma")
        self.assertIn(first, refused.text)
        self.assertIn(second, refused.text)

    def test_an_empty_workspace_is_told_about_tc_init_and_tc_import(self):
        refused = self.refused("tc_resume", root=self.root)
        self.assertIn("tc_init", refused.text)
        self.assertIn("tc_import", refused.text)


class InsideAnotherWorkspaceTest(ToolsTest):
    """A root inside a workspace that has tasks is pointed at that workspace."""

    def test_init_in_a_subfolder_is_refused_and_the_other_tools_point_up(self):
        task = self.init(name="outer work")["task_id"]
        inner = os.path.join(self.root, "src")
        os.makedirs(inner)
        before = tree_listing(self.tmp)
        refused = self.refused("tc_init", root=inner, name="inner")
        self.assertIn(self.root, refused.text)
        self.assertIn(task, refused.text)
        self.assertEqual(tree_listing(self.tmp), before, "nothing is made in the subfolder")
        for tool in ("tc_resume", "tc_show", "tc_capture"):
            text = self.refused(tool, root=inner).text
            self.assertIn("root %r" % self.root, text, tool)

    def test_a_subfolder_with_a_store_of_its_own_keeps_working(self):
        inner = os.path.join(self.root, "pkg")
        os.makedirs(inner)
        self.ok("tc_init", root=inner, name="inner first")
        self.init(name="outer later")
        self.assertEqual(self.ok("tc_resume", root=inner)["name"], "inner first")

class AdoptionLimitsTest(ToolsTest):
    """A store is taken over by a workspace only when the folder its tasks
    name left it behind: never a store another workspace still uses."""

    def test_a_store_another_workspace_names_is_not_taken_over(self):
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        inside = os.path.join(self.root, ".checkpoints")
        task = self.ok("tc_init", root=other, name="the other project", store=inside)["task_id"]
        refused = self.refused("tc_resume", root=self.root)
        self.assertNotIn("tc_switch", refused.text)
        self.assertEqual(self.ok("tc_resume", root=other)["task_id"], task)
        srv = self.server(env={"TC_STORE": inside})
        self.assertTrue(srv.call("tc_resume", root=self.root).is_error)
        self.assertEqual(self.ok("tc_resume", root=other)["task_id"], task)

    def test_a_shared_store_does_not_offer_other_projects_tasks(self):
        shared = os.path.join(self.tmp, "shared")
        srv = self.server(env={"TC_STORE": shared})
        gone = os.path.join(self.tmp, "gone")
        os.makedirs(gone)
        srv.ok("tc_init", root=gone, name="a project since deleted")
        shutil.rmtree(gone)
        refused = srv.call("tc_resume", root=self.root)
        self.assertTrue(refused.is_error)
        self.assertNotIn("tc_switch", refused.text)
        self.assertIn("tc_import", refused.text)

    def test_a_closed_task_whose_folder_is_gone_is_not_changed(self):
        ext = os.path.join(self.tmp, "ext")
        task = self.init(store=ext)["task_id"]
        self.write("a.txt", "a\n")
        self.save("done", close=True)
        moved = os.path.join(self.tmp, "moved")
        os.rename(self.root, moved)
        state_path = os.path.join(ext, "tasks", task, "state.json")
        before = read(os.path.dirname(state_path), "state.json")
        self.assertIn("closed", self.refused("tc_switch", root=moved, task_id=task).text)
        self.assertEqual(read(os.path.dirname(state_path), "state.json"), before)

    def test_a_copy_with_an_external_store_is_told_how_to_continue_the_original(self):
        ext = os.path.join(self.tmp, "ext")
        task = self.init(store=ext)["task_id"]
        copy = os.path.join(self.tmp, "copy")
        shutil.copytree(self.root, copy)
        refused = self.refused("tc_resume", root=copy)
        self.assertIn(task, refused.text)
        self.assertIn("tc_export", refused.text)


class InsideAnotherWorkspaceEdgesTest(ToolsTest):

    def test_an_import_into_a_subfolder_is_refused(self):
        source = os.path.join(self.tmp, "source")
        write(source, "a.txt", "a\n")
        self.ok("tc_init", root=source, name="to hand over")
        self.ok("tc_save", root=source, title="one")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.ok("tc_export", root=source, to=out)["path"]
        self.init(name="outer")
        inner = os.path.join(self.root, "sub")
        os.makedirs(inner)
        refused = self.refused("tc_import", root=inner, package=package)
        self.assertIn(self.root, refused.text)
        self.assertFalse(os.path.exists(os.path.join(inner, ".checkpoints")))

    def test_a_folder_the_outer_task_leaves_out_takes_a_task_of_its_own(self):
        self.init(name="outer", exclude=["packages"])
        inner = os.path.join(self.root, "packages", "app")
        os.makedirs(inner)
        self.ok("tc_init", root=inner, name="inner")
        self.assertEqual(self.ok("tc_resume", root=inner)["name"], "inner")


if __name__ == "__main__":
    unittest.main()
