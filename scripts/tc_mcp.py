"""task-checkpoint-mcp: the stdio MCP adapter and the command line.

Protocol: JSON-RPC 2.0, one message per line, UTF-8 both ways; one response
line per request and none for a notification; stdout carries frames only
(logs go to stderr and the store's server.log). Requests are handled one at
a time in arrival order; the watcher thread shares the store with them
through the store lock. A reader thread takes the lines in as they come, so
a notifications/cancelled stops the tool call it names while that call
runs, or keeps it from starting. Every malformed line gets an error and the
server keeps serving.

Tools: the TOOLS table is the one place a tool is declared (its schemas,
description, hints, handler and the lists its results are cut to);
tools/list, the argument checks, tools/call and fit_result all read it.

Command line: no argument starts the server (saying so in one line on
stderr when stdin is a terminal); --version, --help, --print-skill,
--skill-path and --install-skill DIR [--force]. An argument it does not
know is named on stderr and the server starts anyway, unless stdin is a
terminal (a person typed it: the usage, exit status 2). Commands for
people (status, log, show, diff, restore, undo, capture, export, import,
usage, compress) run the tools' own handlers on the store, as one more
process taking its lock, and print text or, with --json, the result
whole; `hook session-start` and `hook capture` serve the hook systems of
coding clients and always exit 0.
"""

from __future__ import annotations

import os
import sys



def _drop_working_directory():
    """`python -m tc_mcp` (how the npm launcher starts it on Python 3.10)
    puts the working directory, usually the user's project, ahead of the
    standard library: a project's secrets.py or json.py would run in place
    of the real one."""
    try:
        if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.getcwd():
            del sys.path[0]
    except OSError:  # the working directory is gone: nothing can be imported from it
        pass


if __name__ == "__main__" and __spec__ is not None:
    _drop_working_directory()

import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from json.decoder import scanstring as scan_json_string  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

if __package__ in (None, "") and os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tc  # noqa: E402

SERVER_NAME = "task-checkpoint-mcp"
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST_PROTOCOL = PROTOCOL_VERSIONS[-1]
# Revisions without a handshake: each request names its version in _meta.
ENVELOPE_VERSIONS = ("2026-07-28",)
VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities"
SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"
INSTRUCTIONS = ("Call tc_resume first in a new session; tc_init before a long task; tc_save "
                "after each finished step with conclusion and next; preview tc_restore with "
                "apply: false before apply: true.")

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
UNSUPPORTED_VERSION = -32022

TEXT_LIMIT = 100_000
TITLE_LIMIT = 1_000
PATH_LIMIT = 4_096
LIST_LIMIT = 1_000
RESULT_LIST_LIMIT = 100  # entries of a list in a tool result (see fit_result)
DRIFT_LIST_LIMIT = 20  # ... and of each drift's lists in tc_show,
DRIFT_PAGE_LIMIT = 300  # ... whose page (up to 200 drifts) lists at most this many paths
RESULT_BUDGET = 80_000  # bytes of a result's JSON: over it, its long lists are cut shorter
LIST_FLOOR = 10  # ... but not below this many (a drift's lists and a page in proportion)
# Both budgets count UTF-8 bytes with JSON escapes, so a CJK character costs
# its three bytes in each: 60,000 bytes of text stay 60,000 bytes of JSON
# in any script, and leave room under RESULT_BUDGET for the rest.
TEXT_BUDGET = 60_000  # bytes of free text (step texts, goal, handoff) in one result,
TEXT_FLOOR = 100  # ... shared out so that no text is cut below this (or its share),
TEXT_ITEMS_LIMIT = 20  # ... and items of a step's verified or open_questions in a result,
PAGE_ITEMS_LIMIT = 5  # ... of each step on a tc_show page of several steps
LINE_LIMIT = 64 * 1024 * 1024  # bytes of one request line; longer ones are refused unread
# Objects, arrays and commas outside strings in one request line: each small
# value costs far more memory parsed than sent, and no request needs anywhere
# near this many. Only lines over VALUE_CHECK_FROM bytes are counted.
VALUE_LIMIT = 1_000_000
VALUE_CHECK_FROM = 1 << 20
# The id of a request line too large to parse: a member before "params" (after
# "jsonrpc" and "method", in either order), or the last one.
LEADING_ID = re.compile(rb'\s*\{(?:\s*"(?:jsonrpc|method)"\s*:\s*"[^"\\]{0,200}"\s*,){0,2}'
                        rb'\s*"id"\s*:\s*(-?[0-9]{1,18}|"[^"\\]{0,200}")\s*[,}]')
TRAILING_ID = re.compile(rb'[,{]\s*"id"\s*:\s*(-?[0-9]{1,18}|"[^"\\]{0,200}")\s*\}\s*\Z')


def too_many_values(raw):
    """True for a line that would parse into more than VALUE_LIMIT values:
    objects, arrays, commas and strings (a comma or bracket inside a string
    is text). Strings are skipped by the json module's own scanner, so the
    count is one pass whatever the line holds."""
    if len(raw) <= VALUE_CHECK_FROM:
        return False
    if (raw.count(b"{") + raw.count(b"[") + raw.count(b",") + raw.count(b'"') // 2
            <= VALUE_LIMIT):
        return False
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False  # not JSON text: the parser refuses it at once
    total, start = 0, 0
    while True:
        quote = text.find('"', start)
        end = len(text) if quote < 0 else quote
        total += (text.count("{", start, end) + text.count("[", start, end)
                  + text.count(",", start, end))
        if total > VALUE_LIMIT:
            return True
        if quote < 0:
            return False
        try:
            start = scan_json_string(text, quote + 1)[1]
        except ValueError:
            return False  # not JSON: the parser refuses it where this stopped
        total += 1


def unread_request_id(raw):
    """The id of a request line too costly to parse, when it is the first or
    the last member of the line's object (as clients write it); None
    otherwise, and for a line that names no method (not a request)."""
    if b'"method"' not in raw:
        return None
    found = LEADING_ID.match(raw) or TRAILING_ID.search(raw, max(0, len(raw) - 300))
    try:
        return json.loads(found.group(1)) if found else None
    except ValueError:  # not a JSON value after all ("01", a raw control character)
        return None
INBOX_BYTES = 4 * 1024 * 1024  # lines read ahead of the one being handled (one always fits)
INBOX_LINES = 20_000
CANCEL_LINE_LIMIT = 64 * 1024  # a longer line is never taken for a cancel
PROGRESS_EVERY = 1.0  # seconds between progress notices of a call that asked for them


# ---------------------------------------------------------------------------
# Schemas: declared once, used for tools/list and for argument checks
# ---------------------------------------------------------------------------

def s_str(description, *, max_length=TEXT_LIMIT, min_length=None):
    schema = {"type": "string", "description": description, "maxLength": max_length}
    if min_length:
        schema["minLength"] = min_length
    return schema


def s_int(description, *, minimum=None, maximum=None, default=None):
    schema = {"type": "integer", "description": description}
    for key, value in (("minimum", minimum), ("maximum", maximum), ("default", default)):
        if value is not None:
            schema[key] = value
    return schema


def s_bool(description, default=False):
    return {"type": "boolean", "description": description, "default": default}


def s_list(description, *, max_items=LIST_LIMIT, item_length=TEXT_LIMIT):
    return {"type": "array", "description": description, "maxItems": max_items,
            "items": {"type": "string", "maxLength": item_length}}


def s_obj(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


# Every result may carry a note: what the call did besides its own work
# (a store that moved with its workspace followed it, a task adopted).
RESULT_NOTE = {"type": "string", "description": "What the call changed besides its own work, "
                                                "in a sentence to pass on to the user."}


def s_out(properties, required=None):
    """An output schema: every property required unless required names them;
    each may also hold an optional note (RESULT_NOTE)."""
    required = list(properties if required is None else required)
    return {"type": "object", "properties": dict({"note": RESULT_NOTE}, **properties),
            "required": required}


ROOT = s_str("Absolute path of the workspace directory (usually the project root).",
             max_length=PATH_LIMIT, min_length=1)
TASK_ID = s_str("A task id returned by tc_init (or the task's exact name); defaults to the "
                "workspace's active task.",
                max_length=128, min_length=1)
SWITCH_TASK_ID = s_str("The id (from tc_init), or the exact name, of the suspended task to "
                       "make active.",
                       max_length=128, min_length=1)
AGENT = s_str("Who makes this call, when several agents share the task: a short label such "
              "as 'planner' or 'worker-2', kept on what the call records and shown by "
              "tc_show, tc_resume and the handoff.", max_length=tc.AGENT_LIMIT)


def expected_head_schema(what):
    return s_int("The head step number this call is based on, as tc_resume or tc_show last "
                 "gave it (0: no step yet)%s. When the task's head is another step, the call "
                 "is refused with nothing written: call tc_resume and decide again." % what,
                 minimum=0)


NULLABLE_STR = {"type": ["string", "null"]}
STR_LIST = {"type": "array", "items": {"type": "string"}}
SKIPPED = {"type": "array", "items": {"type": "object", "properties": {
    "path": {"type": "string"}, "reason": {"type": "string"}}, "required": ["path", "reason"]}}
GIT = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "ref": NULLABLE_STR, "reason": NULLABLE_STR,
    "unchanged": {"type": ["boolean", "null"]}, "error": {"type": "string"}},
    "required": ["ok", "ref", "reason", "unchanged"]}
OMITTED = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1},
           "description": "What this result left out, by place in the result: for a "
                          "long list the entries left out (lists stop at %d entries; %d for "
                          "each drift tc_show lists and %d for its whole page; fewer when "
                          "the result would be over %d bytes; %d for a "
                          "step's verified and open_questions), e.g. 'drift_paths', "
                          "'plan.to_replace', 'drifts.d0003.added', 'steps.s0003.verified'; "
                          "for long texts the characters left out (the texts of one "
                          "result share %d bytes), e.g. 'last.conclusion', or "
                          "'steps.s0003.texts' for all the texts of a step. The records "
                          "keep everything."
                          % (RESULT_LIST_LIMIT, DRIFT_LIST_LIMIT, DRIFT_PAGE_LIMIT,
                             RESULT_BUDGET, TEXT_ITEMS_LIMIT, TEXT_BUDGET)}
USAGE = {"type": "object", "description": "Where the store's bytes go (after this call): "
         "the whole store, its content, each task (its records' bytes and the content they "
         "name, shared content counted for each task), the content only drift records hold, "
         "what keep_seconds 0 would free, and what TC_STORE_BUDGET reclaimed.",
         "properties": {
             "total_bytes": {"type": "integer"}, "content_bytes": {"type": "integer"},
             "content_files": {"type": "integer"}, "drift_only_bytes": {"type": "integer"},
             "freed_at_keep_seconds_0": {"type": "integer"},
             "tasks": {"type": "array", "items": {"type": "object"}},
             "budget": {"type": "object"}},
         "required": ["total_bytes", "content_bytes", "tasks", "drift_only_bytes",
                      "freed_at_keep_seconds_0"]}
DIFF = {"type": "array", "description": "One entry per changed file, by path: change "
        "'write' (new), 'delete' or 'replace'; added and removed count lines; patch is a "
        "unified diff (3 lines of context, --- a/<path> before, +++ b/<path> after) cut "
        "after %d lines with a line saying how many were left out, or null with reason "
        "'binary', 'sensitive', 'over 1 MB' or why the content is missing; a change of the "
        "mode alone has an empty patch and its reason. Entries that would take the result "
        "over %d bytes are left out and counted in omitted.diff." % (tc.PATCH_LINE_LIMIT,
                                                                      RESULT_BUDGET),
        "items": {"type": "object", "properties": {
            "path": {"type": "string"}, "change": {"enum": ["write", "delete", "replace"]},
            "added": {"type": ["integer", "null"]}, "removed": {"type": ["integer", "null"]},
            "patch": NULLABLE_STR, "reason": NULLABLE_STR},
            "required": ["path", "change", "added", "removed", "patch", "reason"]}}
PLAN = {"type": "object", "properties": {
    "to_delete": STR_LIST, "to_write": STR_LIST, "to_replace": STR_LIST,
    "unrestorable": SKIPPED}, "required": ["to_delete", "to_write", "to_replace", "unrestorable"]}


# ---------------------------------------------------------------------------
# Tool handlers: arguments in, plain dict out
# ---------------------------------------------------------------------------

def present(arguments, *names):
    """The arguments among names that a call has, as keywords: one whose
    schema has no default and that the client left out is not passed, so
    the core's own default applies."""
    return {name: arguments[name] for name in names if name in arguments}


def call_init(cp, a):
    return cp.init(a["root"], a["name"], **present(a, "goal", "constraints", "store", "exclude",
                                                   "agent"))


def call_switch(cp, a):
    return cp.switch(a["root"], a["task_id"])


def call_save(cp, a):
    return cp.save(a["root"], a["title"], **present(
        a, "task_id", "description", "conclusion", "next", "verified", "open_questions",
        "close", "paths", "expected_head", "agent"))


def call_capture(cp, a):
    return cp.capture(a["root"], **present(a, "agent", "label"))


def call_show(cp, a):
    return cp.show(a["root"], **present(a, "task_id", "index", "include_drift", "limit",
                                        "cursor", "diff"))


def call_restore(cp, a):
    return cp.restore(a["root"], **present(a, "index", "drift_id", "apply", "task_id", "paths",
                                           "diff", "plan_id", "expected_head", "agent"))


def call_resume(cp, a):
    return cp.resume(a["root"], **present(a, "task_id"))


def call_export(cp, a):
    return cp.export(a["root"], a["to"], **present(a, "history"))


def call_import(cp, a):
    return cp.import_package(a["root"], a["package"])


def call_compress(cp, a):
    return cp.compress(a["root"], **present(a, "keep_seconds", "minimum", "maximum",
                                            "dry_run"))


# ---------------------------------------------------------------------------
# The tools: each declared once, in TOOLS
# ---------------------------------------------------------------------------

# (collections.namedtuple rather than typing.NamedTuple: the typing module
# costs every server start a few milliseconds.)
# Why the read-only tools may still write: the lock every call takes first
# finishes what a killed process left half done (Store.recover).
CRASH_CLAUSE = ("It changes nothing itself; like any call, it first rolls back a restore or "
                "import a killed process left half done, and its note then says so.")


class Hints(collections.namedtuple("Hints", "title read_only destructive idempotent",
                                   defaults=(False, False, False))):
    """What a client may show or decide before calling a tool: its title,
    whether it only reads, whether it may overwrite or delete what it cannot
    give back by itself (a restore or an import overwrites workspace files,
    which its recovered record brings back; compress deletes stored content
    for good), and whether calling it again has the same effect."""

    __slots__ = ()

    def annotations(self):
        return {"title": self.title, "readOnlyHint": self.read_only,
                "destructiveHint": self.destructive, "idempotentHint": self.idempotent,
                "openWorldHint": False}


class Tool(collections.namedtuple("Tool", "hints description input output handler long_lists "
                                          "byte_lists", defaults=(None, ()))):
    """One tool, as tools/list shows it and tools/call checks and runs it.

    hints: Hints; input and output: the JSON schemas. handler(checkpoints,
    arguments) returns the result as a plain dict; its arguments fit input
    and have the schema's defaults filled in (see normalized), so a handler
    never restates a default. long_lists: the lists of a result fit_result
    cuts, by place ("plan.to_write"); None for a result that is passed on
    whole. byte_lists: top-level lists of large entries (a diff's patches)
    that get the room the rest of the result leaves, entry by entry (see
    fit_entries)."""

    __slots__ = ()


# The one place a tool is declared: tools/list, the argument checks, the
# dispatch of tools/call and fit_result all read this table.
TOOLS = {
    "tc_init": Tool(
        hints=Hints("Start a task"),
        description="Start a long task in a workspace: names it, records its goal and the "
                    "workspace as it is now (drift record d0001), and makes it the active task "
                    "that the other tools act on. An already active task is suspended, not "
                    "closed. skipped_paths names what the records leave out (sensitive names, "
                    "files over 100 MB, folders such as node_modules) and why.",
        input=s_obj({
            "root": ROOT,
            "name": s_str("Short task name.", max_length=TITLE_LIMIT, min_length=1),
            "goal": s_str("What the task should achieve."),
            "constraints": s_str("Rules the work must respect."),
            "store": s_str("Absolute path of a store outside the default <root>/.checkpoints.",
                           max_length=PATH_LIMIT, min_length=1),
            "exclude": s_list("Extra names to leave out of every scan: single-name globs such "
                              "as 'data' or '*.log' (no '/').", item_length=PATH_LIMIT),
            "agent": AGENT,
        }, ["root", "name"]),
        output=s_out({
            "task_id": {"type": "string"}, "name": {"type": "string"},
            "store": {"type": "string"}, "store_is_external": {"type": "boolean"},
            "prev_suspended": NULLABLE_STR, "exclude": STR_LIST, "note": {"type": "string"},
            "skipped_paths": SKIPPED, "omitted": OMITTED}),
        handler=call_init,
        long_lists=("skipped_paths",),
    ),
    "tc_switch": Tool(
        hints=Hints("Return to a suspended task", idempotent=True),
        description="Make a suspended task of this workspace the active one again (task_id: "
                    "its id, or its exact name). A task whose workspace folder is gone (moved) "
                    "becomes this workspace's.",
        input=s_obj({"root": ROOT, "task_id": SWITCH_TASK_ID}, ["root", "task_id"]),
        output=s_out({"task_id": {"type": "string"}, "status": {"type": "string"}}),
        handler=call_switch,
    ),
    "tc_save": Tool(
        hints=Hints("Save a finished step"),
        description="Save one finished step of the active task (or of task_id, which then "
                    "becomes the active one): what was done (title), what it concluded, and "
                    "what comes next. Records every file of the workspace. Call after each "
                    "step; close: true finishes the task. idempotent: true means the same step "
                    "was already saved; groups pairs top-level X.p3d files with their X.p3dat; "
                    "skipped_paths names what this save newly left out and why; git.unchanged "
                    "is true when the repository's HEAD, index, refs and stash were the same "
                    "before and after (null when not checked).",
        input=s_obj({
            "root": ROOT,
            "title": s_str("One line: what this step did.", max_length=TITLE_LIMIT, min_length=1),
            "task_id": TASK_ID,
            "description": s_str("Why it was done this way."),
            "conclusion": s_str("What this step established. The most useful field."),
            "next": s_str("What to do next."),
            "verified": s_list("What was actually checked (tests run, facts confirmed)."),
            "open_questions": s_list("Questions left for later."),
            "close": s_bool("Close the task after this save (it stays readable)."),
            "paths": dict(s_list("Must be empty: a save always records the whole workspace.",
                                 item_length=PATH_LIMIT), maxItems=0),
            "expected_head": expected_head_schema(""),
            "agent": AGENT,
        }, ["root", "title"]),
        output=s_out({
            "task_id": {"type": "string"}, "index": {"type": "integer"},
            "title": {"type": "string"}, "groups": {"type": "array"},
            "skipped_paths": SKIPPED, "idempotent": {"type": "boolean"},
            "closed": {"type": "boolean"}, "status": {"type": "string"},
            "active_task_changed": {"type": "boolean"}, "git": GIT, "omitted": OMITTED}),
        handler=call_save,
        long_lists=("skipped_paths", "groups"),
    ),
    "tc_capture": Tool(
        hints=Hints("Record file changes now", idempotent=True),
        description="Record file changes on disk now as a drift record of the active task, "
                    "without waiting for the background watcher's quiet period. captured: "
                    "false just means nothing changed since the last record; waiting: true "
                    "means the watcher was still waiting for the files to settle (the record "
                    "is then partial); reads counts the files whose content was read. Drift "
                    "ids (d0001, d0002, ...) count per task.",
        input=s_obj({
            "root": ROOT, "agent": AGENT,
            "label": s_str("A few words naming this moment, kept on the drift record "
                           "(e.g. 'before the schema migration').", max_length=200),
        }, ["root"]),
        output=s_out({
            "captured": {"type": "boolean"}, "waiting": {"type": "boolean"},
            "drift_id": NULLABLE_STR, "partial": {"type": "boolean"},
            "reads": {"type": "integer"}, "skipped_paths": SKIPPED,
            "added": STR_LIST, "modified": STR_LIST, "deleted": STR_LIST, "omitted": OMITTED},
            ["captured", "waiting", "drift_id", "partial", "reads", "skipped_paths", "omitted"]),
        handler=call_capture,
        long_lists=("skipped_paths", "added", "modified", "deleted"),
    ),
    "tc_show": Tool(
        hints=Hints("List steps and drift records", read_only=True, idempotent=True),
        description="List the steps of the active task (or of task_id), newest last, a page "
                    "at a time; include_drift adds the drift records that belong to the page's "
                    "steps; index shows one step with its files, and with diff: true what that "
                    "step changed. " + CRASH_CLAUSE,
        input=s_obj({
            "root": ROOT, "task_id": TASK_ID,
            "index": s_int("Show this step with its files.", minimum=1),
            "include_drift": s_bool("Also list drift records."),
            "limit": s_int("Items per page.", minimum=1, maximum=200, default=50),
            "cursor": s_int("Where the page starts (next_cursor of the previous page).",
                            minimum=0, default=0),
            "diff": s_bool("With index: add 'diff', what that step changed against the step "
                           "before it (the first step against the task's baseline)."),
        }, ["root"]),
        output=s_out({
            "steps": {"type": "array"}, "drifts": {"type": "array"},
            "head": {"type": "integer"}, "next_cursor": {"type": ["integer", "null"]},
            "task_id": {"type": "string"}, "status": {"type": "string"}, "diff": DIFF,
            "omitted": OMITTED},
            ["steps", "drifts", "head", "next_cursor", "omitted"]),
        handler=call_show,
        # The drift records of a page (those of its steps), and each one's
        # added, modified and deleted; the steps themselves come in pages.
        long_lists=("drifts",),
        byte_lists=("diff",),
    ),
    "tc_restore": Tool(
        hints=Hints("Restore a step or a drift record", destructive=True),
        description="Roll the workspace back (or forward) to a step (index) or a drift "
                    "record (drift_id) of the active task, or of the task task_id names (a "
                    "closed one too: its files are written here and the undo is recorded "
                    "in the open task). paths limits it to some files and folders. "
                    "apply: false previews the plan (diff: true adds each file's diff); "
                    "apply: true with the preview's plan_id does it only if nothing changed "
                    "since, and returns 'recovered', the drift id that undoes it, a "
                    "'receipt' of the files read back, the steps it 'voided' and a 'note' "
                    "to paste into the conversation.",
        input=s_obj({
            "root": ROOT,
            "index": s_int("Step number to restore.", minimum=1),
            "drift_id": s_str("Drift record to restore, e.g. 'd0003'.", max_length=32,
                              min_length=1),
            "apply": s_bool("false: preview only; true: change the workspace."),
            "expected_head": expected_head_schema("; checked only with apply: true"),
            "agent": AGENT,
            "task_id": s_str("The task whose step or drift record is restored; defaults to "
                             "the active task. Another task of this workspace (a closed one "
                             "included) is left unchanged: the restore is recorded in the "
                             "open task.", max_length=128, min_length=1),
            "paths": s_list("Restore only these workspace-relative files or folders "
                            "('/'-separated, a folder meaning everything under it); every "
                            "other file stays as it is and the head does not move.",
                            item_length=PATH_LIMIT),
            "diff": s_bool("Add 'diff': for each planned file, a unified diff from the "
                           "workspace now to the target."),
            "plan_id": s_str("With apply: true, the plan_id its preview returned: refused, "
                             "with nothing written, when the plan is no longer the same.",
                             max_length=64, min_length=64),
        }, ["root"]),
        output=s_out({
            "applied": {"type": "boolean"}, "recovered": NULLABLE_STR, "plan": PLAN,
            "skipped_paths": SKIPPED, "head": {"type": "integer"}, "target": {"type": "string"},
            "plan_id": {"type": "string", "description": "A digest of the target and of the "
                        "current state of every planned path; pass it with apply: true."},
            "receipt": {"type": ["object", "null"], "description": "After an apply (null "
                        "for a preview): verified counts the files read back as restored "
                        "(or found gone); mismatched lists the others, which tc_resume's "
                        "health names until the next save.", "properties": {
                            "verified": {"type": "integer"}, "mismatched": SKIPPED},
                        "required": ["verified", "mismatched"]},
            "voided": {"type": "array", "description": "The steps after the target up to the "
                       "head it replaces, newest first: their conclusions no longer describe "
                       "the files on disk. Empty for a drift, paths or other task's restore.",
                       "items": {"type": "object", "properties": {
                           "index": {"type": "integer"}, "title": {"type": "string"},
                           "conclusion": {"type": "string"}},
                           "required": ["index", "title", "conclusion"]}},
            "note": {"type": "string", "description": "Plain lines to paste into the "
                     "conversation: what was restored, which steps it undid, how to undo it."},
            "diff": DIFF, "omitted": OMITTED},
            ["applied", "recovered", "plan", "skipped_paths", "plan_id", "receipt", "voided",
             "note", "omitted"]),
        handler=call_restore,
        long_lists=("skipped_paths", "plan.to_delete", "plan.to_write",
                    "plan.to_replace", "plan.unrestorable", "voided", "receipt.mismatched"),
        byte_lists=("diff",),
    ),
    "tc_resume": Tool(
        hints=Hints("Pick the task up", read_only=True, idempotent=True),
        description="Read-only: everything a new session needs to continue the active task "
                    "(or task_id), with a ready-made handoff text, the last step, the newest "
                    "steps (recent), and the paths changed but not yet recorded. " + CRASH_CLAUSE,
        input=s_obj({"root": ROOT, "task_id": TASK_ID}, ["root"]),
        output=s_out({
            "goal": {"type": "string"}, "constraints": {"type": "string"},
            "head": {"type": "integer"},
            "last": {"type": "object", "properties": {
                "title": {"type": "string"}, "conclusion": {"type": "string"},
                "description": {"type": "string"}, "next": {"type": "string"},
                "verified": STR_LIST, "agent": {"type": "string"}},
                "required": ["title", "conclusion", "description", "next", "verified", "agent"]},
            "recent": {"type": "array", "description": "The newest steps (up to five), newest "
                       "first.", "items": {"type": "object", "properties": {
                           "index": {"type": "integer"}, "title": {"type": "string"}},
                           "required": ["index", "title"]}},
            "open_questions": STR_LIST, "drift_paths": STR_LIST, "next": {"type": "string"},
            "changed_since_step": STR_LIST, "handoff": {"type": "string"},
            "health": {"type": "object", "properties": {
                "ok": {"type": "boolean"}, "errors": STR_LIST}, "required": ["ok", "errors"]},
            "store": {"type": "string"}, "active_task": NULLABLE_STR, "skipped": SKIPPED,
            "task_id": {"type": "string"}, "name": {"type": "string"},
            "status": {"type": "string"}, "omitted": OMITTED},
            ["goal", "constraints", "head", "last", "open_questions", "drift_paths", "next",
             "changed_since_step", "handoff", "health", "store", "active_task", "skipped",
             "recent", "omitted"]),
        handler=call_resume,
        long_lists=("drift_paths", "changed_since_step", "skipped", "health.errors"),
    ),
    "tc_export": Tool(
        hints=Hints("Write a handoff package"),
        description="Write a handoff package <task_id>-handoff/ of the active task into an "
                    "existing directory outside the workspace: HANDOFF.md, a description and "
                    "the current step's files (sensitive files left out). history: true adds "
                    "every step. changed_since_step lists files changed after that step, which "
                    "the package lacks: save first to include them.",
        input=s_obj({
            "root": ROOT,
            "to": s_str("Absolute path of an existing directory.", max_length=PATH_LIMIT,
                        min_length=1),
            "history": s_bool("Include every step so the receiver can restore any of them."),
        }, ["root", "to"]),
        output=s_out({"path": {"type": "string"}, "filtered": SKIPPED, "files": STR_LIST,
                      "changed_since_step": STR_LIST, "omitted": OMITTED}),
        handler=call_export,
        long_lists=("files", "filtered", "changed_since_step"),
    ),
    "tc_import": Tool(
        hints=Hints("Continue a task from a handoff package", destructive=True),
        description="Continue a task from a handoff package in this workspace: checks the "
                    "package, writes its files, makes the task active. When files already "
                    "here are overwritten, 'recovered' is the drift id that brings them back.",
        input=s_obj({
            "root": ROOT,
            "package": s_str("Absolute path of the package directory tc_export returned.",
                             max_length=PATH_LIMIT, min_length=1),
        }, ["root", "package"]),
        output=s_out({"task_id": {"type": "string"}, "recovered": NULLABLE_STR,
                      "skipped_paths": SKIPPED, "omitted": OMITTED},
                     ["task_id", "recovered", "skipped_paths"]),
        handler=call_import,
        long_lists=("skipped_paths",),
    ),
    "tc_compress": Tool(
        hints=Hints("Reclaim space from old drift records", destructive=True),
        description="Reclaim space held by old drift records' content (of this workspace's "
                    "tasks), and by content no record names (left by an interrupted save). "
                    "Steps and recovered records are never touched.",
        input=s_obj({
            "root": ROOT,
            "keep_seconds": s_int("Keep drift content younger than this.", minimum=0,
                                  default=604800),
            "minimum": s_int("Always keep this many newest copies of each path.", minimum=0,
                             default=20),
            "maximum": s_int("Never keep more than this many copies of a path.", minimum=0,
                             default=50),
            "dry_run": s_bool("Only report what would be reclaimed, and where the space "
                              "goes; delete nothing."),
        }, ["root"]),
        output=s_out(dict({k: {"type": "integer"} for k in (
            "converted", "eligible", "already_gone", "unreferenced", "bytes_freed",
            "keep_seconds", "minimum", "maximum")}, dry_run={"type": "boolean"}, usage=USAGE),
            None),
        handler=call_compress,
    ),
}


# ---------------------------------------------------------------------------
# Argument validation against the input schemas
# ---------------------------------------------------------------------------

JSON_TYPES = {"string": str, "boolean": bool, "array": list, "object": dict}


def type_ok(value, expected):
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "null":
        return value is None
    return isinstance(value, JSON_TYPES[expected])


def brief(value, limit=60):
    """repr(value), cut to about limit characters: a name a client made up
    is echoed in an error, never at whatever length it was sent."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_value(name, value, schema):
    """None when value fits schema, else a sentence naming the argument."""
    expected = schema.get("type")
    if expected == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)
    if expected and not type_ok(value, expected):
        return "argument %r must be %s %s, got %s" % (
            name, "an" if expected[0] in "aeiou" else "a", expected, describe_json(value))
    if expected == "integer":
        if "minimum" in schema and value < schema["minimum"]:
            return "argument %r must be >= %d, got %s" % (name, schema["minimum"],
                                                          brief(value))
        if "maximum" in schema and value > schema["maximum"]:
            return "argument %r must be <= %d, got %s" % (name, schema["maximum"],
                                                          brief(value))
    if expected == "string":
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "argument %r contains an unpaired surrogate (not valid Unicode text)" % name
        if len(value) < schema.get("minLength", 0):
            if not value or schema["minLength"] == 1:
                return "argument %r must not be empty" % name
            return "argument %r must be %d characters, got %d%s" % (
                name, schema["minLength"], len(value),
                "; pass the whole plan_id the preview (apply: false) returned"
                if name == "plan_id" else "")
        if len(value) > schema.get("maxLength", TEXT_LIMIT):
            return "argument %r is too long (%d characters, at most %d)" % (
                name, len(value), schema.get("maxLength", TEXT_LIMIT))
    if expected == "array":
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            if schema["maxItems"] == 0:
                return "argument %r must be empty" % name
            return "argument %r has too many items (%d, at most %d)" % (
                name, len(value), schema["maxItems"])
        for position, item in enumerate(value):
            problem = check_value("%s[%d]" % (name, position), item, schema["items"])
            if problem:
                return problem
    return None


def describe_json(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


UNKNOWN_NAMES_SHOWN = 5


def check_arguments(arguments, schema):
    """A list of problems with arguments; empty when they fit the schema."""
    problems = []
    properties = schema["properties"]
    for name in schema["required"]:
        if name not in arguments:
            problems.append("missing required argument %r" % name)
    unknown = []
    for name, value in arguments.items():
        if name not in properties:
            unknown.append(name)
            continue
        problem = check_value(name, value, properties[name])
        if problem:
            problems.append(problem)
    if unknown:
        named = ", ".join(brief(name) for name in unknown[:UNKNOWN_NAMES_SHOWN])
        if len(unknown) > UNKNOWN_NAMES_SHOWN:
            named += " and %d more" % (len(unknown) - UNKNOWN_NAMES_SHOWN)
        problems.append("unknown argument%s %s (accepted: %s)" % (
            "s" if len(unknown) > 1 else "", named, ", ".join(properties)))
    return problems


def normalized(arguments, schema):
    """Arguments with integral floats made ints and defaults filled in."""
    out = {}
    for name, prop in schema["properties"].items():
        if name in arguments:
            value = arguments[name]
            if prop.get("type") == "integer" and isinstance(value, float):
                value = int(value)
            out[name] = value
        elif "default" in prop:
            out[name] = prop["default"]
    return out


# Clients hand a tool's structured result to the model whole, and refuse or
# shelve one that is too long. So a list that grows with the workspace (one
# its Tool's long_lists names) stops at RESULT_LIST_LIMIT entries in a result
# (DRIFT_LIST_LIMIT for each drift that tc_show lists, DRIFT_PAGE_LIMIT for
# all of them together), and "omitted" says how many each cut list left out,
# named by its place in the result: "drift_paths", "plan.to_replace",
# "drifts.d0003.added". The store keeps every entry.
DRIFT_LISTS = ("added", "modified", "deleted")


def fit_result(name, result):
    """A copy of a tool's result with its long texts and lists cut, and
    "omitted" counting what each cut left out. The texts are cut once
    (bound_texts); the list limits are then halved, not below LIST_FLOOR,
    while the result's JSON is over RESULT_BUDGET bytes: long paths or long
    texts must not push a result past what a client passes on to the model.
    What is not in these lists (a page of steps) can keep it over. A list of
    large entries (the tool's byte_lists: a diff) then gets the room the
    rest leaves under RESULT_BUDGET (fit_entries).

    The handoff of a tc_resume result is never cut: its own size comes out
    of TEXT_BUDGET first, and the other texts share what is left, never
    less than a quarter of the budget."""
    tool = TOOLS.get(name)
    if tool is None or tool.long_lists is None or not isinstance(result, dict):
        return result
    result = dict(result)
    sized = {key: result.pop(key) for key in tool.byte_lists if isinstance(result.get(key), list)}
    texts_omitted = {}
    if name in ("tc_resume", "tc_show"):
        handoff = result.get("handoff")
        reserved = json_size(handoff) if isinstance(handoff, str) else 0
        bound_texts(text_slots(result, texts_omitted), texts_omitted,
                    budget=max(TEXT_BUDGET // 4, TEXT_BUDGET - reserved))
    limit = RESULT_LIST_LIMIT
    bounded, omitted = cut_lists(name, result, limit)
    size = encoded_size(bounded)
    while limit > LIST_FLOOR and size > RESULT_BUDGET:
        limit = max(LIST_FLOOR, limit // 2)
        shorter, more = cut_lists(name, result, limit)
        if more != omitted:  # else nothing more was cut, and the size is the same
            bounded, omitted = shorter, more
            size = encoded_size(bounded)
    omitted.update(texts_omitted)
    for key, entries in sized.items():
        room = RESULT_BUDGET - size - OMITTED_ROOM
        bounded[key], left_out = fit_entries(entries, room)
        size += encoded_size(bounded[key])
        if left_out:
            omitted[key] = left_out
    bounded["omitted"] = omitted
    return bounded


OMITTED_ROOM = 1_000  # bytes kept for "omitted" when the room of a byte list is shared out


def fit_entries(entries, room):
    """(the first entries whose JSON fits room bytes, at most RESULT_LIST_LIMIT
    of them; how many were left out). The first entry that does not fit
    whole keeps as many lines of its patch as fit, its last line saying how
    many it left out; the entries after it are left out."""
    kept = []
    room -= 2  # the list's brackets
    for entry in entries[:RESULT_LIST_LIMIT]:
        size = encoded_size(entry) + 2  # and a separator
        if size <= room:
            kept.append(entry)
            room -= size
            continue
        shorter = shorter_patch(entry, room - 2)
        if shorter is not None:
            kept.append(shorter)
        break
    return kept, len(entries) - len(kept)


def shorter_patch(entry, room):
    """entry with its patch cut to the most lines that fit room bytes, or
    None when not even its file lines fit."""
    patch = entry.get("patch") if isinstance(entry, dict) else None
    if not isinstance(patch, str):
        return None
    low, high, best = 2, len(tc.patch_lines(patch)), None
    while low <= high:  # the most lines kept whose entry fits
        middle = (low + high) // 2
        candidate = dict(entry, patch=tc.cut_patch(patch, middle))
        if encoded_size(candidate) <= room:
            best, low = candidate, middle + 1
        else:
            high = middle - 1
    return best


def encoded_size(result):
    return len(json.dumps(result, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def cut_lists(name, result, limit):
    """(a copy of result with its long lists cut to limit entries, a drift's
    lists and a page of drifts in proportion; {label: entries left out})."""
    result = dict(result)
    omitted = {}
    drift_limit = max(1, DRIFT_LIST_LIMIT * limit // RESULT_LIST_LIMIT)

    def cut(holder, key, label, limit=limit):
        values = holder.get(key)
        if isinstance(values, list) and len(values) > limit:
            holder[key] = values[:limit]
            omitted[label] = len(values) - limit

    for label in TOOLS[name].long_lists:
        holder = result
        *parents, key = label.split(".")
        for part in parents:
            child = holder.get(part)
            if not isinstance(child, dict):  # (a null receipt) nothing to cut
                break
            holder[part] = holder = dict(child)
        else:
            cut(holder, key, label)
    if name == "tc_show" and isinstance(result.get("drifts"), list):
        room = DRIFT_PAGE_LIMIT * limit // RESULT_LIST_LIMIT
        drifts = []
        for view in result["drifts"]:
            view = dict(view)
            for key in DRIFT_LISTS:
                cut(view, key, "drifts.%s.%s" % (view.get("id"), key),
                    min(drift_limit, room))
                if isinstance(view.get(key), list):
                    room -= len(view[key])
            drifts.append(view)
        result["drifts"] = drifts
    return result, omitted


STEP_TEXTS = ("title", "description", "conclusion", "next")
STEP_TEXT_LISTS = ("verified", "open_questions")
# The handoff is not among them: it is built small (each of its texts and
# path lists bounded, see tc.handoff_field), takes its share of TEXT_BUDGET
# first, and is given whole, so that its last lines (next step, unrecorded
# files) are never the ones cut.
RESUME_TEXTS = ("name", "goal", "constraints", "next")


def text_slots(result, omitted):
    """(holder, key, label) of each free text of a tc_resume or tc_show
    result, in copies of their holders; lists of texts are cut to their
    item limit first. The texts of one step in tc_show share one label
    (steps.sNNNN.texts), so that omitted stays short on a long page."""
    slots = []

    def texts(holder, keys, label=None):
        slots.extend((holder, key, label or key) for key in keys
                     if isinstance(holder.get(key), str))

    def text_list(holder, key, name, limit, label=None):
        values = holder.get(key)
        if not isinstance(values, list):
            return
        if len(values) > limit:
            omitted[name] = len(values) - limit
        values = holder[key] = values[:limit]
        slots.extend((values, i, label or "%s.%d" % (name, i))
                     for i, value in enumerate(values) if isinstance(value, str))

    texts(result, RESUME_TEXTS)
    text_list(result, "open_questions", "open_questions", TEXT_ITEMS_LIMIT)
    if isinstance(result.get("last"), dict):
        last = result["last"] = dict(result["last"])
        slots.extend((last, key, "last." + key) for key in STEP_TEXTS
                     if isinstance(last.get(key), str))
        text_list(last, "verified", "last.verified", TEXT_ITEMS_LIMIT)
    if isinstance(result.get("steps"), list):
        steps = result["steps"] = [dict(step) if isinstance(step, dict) else step
                                   for step in result["steps"]]
        limit = TEXT_ITEMS_LIMIT if len(steps) <= 1 else PAGE_ITEMS_LIMIT
        for step in steps:
            if isinstance(step, dict):
                prefix = "steps.s%04d." % step.get("index", 0)
                texts(step, STEP_TEXTS, prefix + "texts")
                for key in STEP_TEXT_LISTS:
                    text_list(step, key, prefix + key, limit, prefix + "texts")
    return slots


TEXT_MARK = " … [%d more characters]"
MARK_SIZE = 32  # bytes a mark may take, counted against the budget


def text_cap(sizes, budget, mark=0):
    """The largest cap c such that the texts fit budget when each one over
    c + mark is cut to c and marked (mark bytes more); sizes in ascending
    order. 0 when the marks alone would not fit."""
    remaining = budget
    for i, size in enumerate(sizes):
        left = len(sizes) - i
        share = (remaining - left * mark) // left
        if size > share + mark:
            return max(share, 0)
        remaining -= size
    return sizes[-1] if sizes else budget


def json_size(text):
    """The bytes text takes inside a JSON string of a result: its UTF-8
    form with escapes (a control character takes six), without quotes."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


_SHORT_ESCAPES = frozenset('\n\r\t\b\f"\\')


def json_prefix(text, limit):
    """The longest start of text whose json_size fits limit."""
    used = 0
    for i, char in enumerate(text):
        code = ord(char)
        if char in _SHORT_ESCAPES:
            used += 2
        elif code < 0x20:
            used += 6
        else:
            used += 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4
        if used > limit:
            return text[:i]
    return text


def bound_texts(slots, omitted, *, budget=TEXT_BUDGET):
    """Cut the longest texts, each to the same size, until all of them
    together fit budget bytes as JSON (marks included); short texts stay
    whole. No text is cut below TEXT_FLOOR bytes, or below its share of the
    budget when there are very many. Bytes rather than characters: they
    follow what a model is charged for a text more closely. A cut text ends
    by saying how much it left out."""
    sizes = [json_size(holder[key]) for holder, key, _label in slots]
    if sum(sizes) <= budget:
        return
    cap = text_cap(sorted(sizes), budget, MARK_SIZE)
    cap = max(cap, min(TEXT_FLOOR, budget // len(slots) - MARK_SIZE))
    for (holder, key, label), size in zip(slots, sizes):
        if size <= cap + MARK_SIZE:
            continue
        text = holder[key]
        kept = json_prefix(text, cap)
        holder[key] = kept + TEXT_MARK % (len(text) - len(kept))
        omitted[label] = omitted.get(label, 0) + len(text) - len(kept)


def tool_result(payload, *, is_error=False):
    if is_error:
        return {"content": [{"type": "text", "text": payload}], "isError": True}
    text = json.dumps(payload, ensure_ascii=False)
    return {"content": [{"type": "text", "text": text}], "structuredContent": payload,
            "isError": False}


class RpcError(Exception):
    def __init__(self, code, message, data=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


# ---------------------------------------------------------------------------
# The server: one request at a time, errors mapped in one place
# ---------------------------------------------------------------------------

class Logger:
    """Lines to stderr and to the server.log of the stores in use (best effort),
    and of the store a line is about (store=, per_store)."""

    MAX_LOG_BYTES = 1 << 20
    per_store = True

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.lock = threading.Lock()
        self.store_dirs = []

    def __call__(self, message, store=None):
        line = "%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message)
        with self.lock:
            try:
                self.stream.write(line)
                self.stream.flush()
            except (OSError, ValueError):
                pass
            directories = list(self.store_dirs)
            if store is not None and store not in directories:
                directories.append(store)
            for directory in directories:
                self._append(directory, line)

    def _append(self, directory, line):
        path = os.path.join(directory, "server.log")
        try:
            if os.path.getsize(path) > self.MAX_LOG_BYTES:
                os.replace(path, path + ".1")
        except OSError:
            pass
        try:
            if os.path.isdir(directory):
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(line)
        except OSError:
            pass


class Heartbeat:
    """notifications/progress for a tool call that asked for them with
    params._meta.progressToken: one every PROGRESS_EVERY seconds until the
    call ends, the last one before its response. A client that restarts its
    request timeout on progress (the Inspector waits 10 s otherwise) then
    waits out a long init, restore, export or import. The progress value is
    the seconds spent so far, so it grows with every notice; there is no
    total."""

    def __init__(self, send, token, name, cancel=None):
        self.send, self.token, self.name = send, token, name
        self.cancel = cancel  # a cancelled call sends no more progress
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._done.set()
        self._thread.join()

    def _run(self):
        started = time.monotonic()
        while not self._done.wait(PROGRESS_EVERY):
            if self.cancel is not None and self.cancel.is_set():
                return
            elapsed = time.monotonic() - started
            try:
                self.send({"jsonrpc": "2.0", "method": "notifications/progress", "params": {
                    "progressToken": self.token, "progress": round(elapsed, 3),
                    "message": "%s: still working (%d s)" % (self.name, elapsed)}})
            except (OSError, ValueError):  # the client is gone; the call still finishes
                return


def progress_token(params):
    meta = params.get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    if isinstance(token, (str, int)) and not isinstance(token, bool):
        return token
    return None


def id_key(value):
    """A request id as a dict key (a string and a number never match), or
    None for what cannot be a request id."""
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("n", value)
    return None


CANCEL_METHOD = "notifications/cancelled"


ESCAPED_NAME_LINE_LIMIT = 4096  # a longer line is not parsed for an escaped spelling


def may_name(raw, literal, word):
    """Whether a line can hold the JSON string literal (bytes, with its
    quotes or not): spelt as it is, or, in a short line, with escapes (a
    JSON encoder may write "/" as "\\/", any character as "\\uXXXX"). A
    cheap test that rules most lines out before any parse; word is a run of
    the literal without "/"."""
    if literal in raw:
        return True
    return (len(raw) <= ESCAPED_NAME_LINE_LIMIT and b"\\" in raw
            and (word in raw or b"\\u" in raw))


def cancelled_request(raw):
    """The id key of the request a notifications/cancelled line names, or None."""
    if len(raw) > CANCEL_LINE_LIMIT or not may_name(raw, CANCEL_METHOD.encode(), b"cancelled"):
        return None
    try:
        message = load_message(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if (not isinstance(message, dict) or message.get("method") != CANCEL_METHOD
            or "id" in message or message.get("jsonrpc") != "2.0"
            or not isinstance(message.get("params"), dict)):
        return None
    return id_key(message["params"].get("requestId"))


class Cancels:
    """Cancellations, seen by the reader thread the moment they arrive.

    Each line gets a sequence number as it is read. A cancel applies to the
    tools/call with its id that is running, or queued before it; never to a
    later request that reuses the id. A cancelled call that has not started
    is skipped; a running one stops at its next safe point (tc.cancellable).
    Either way no response is sent, as the protocol asks."""

    LIMIT = 1024  # cancels remembered; the oldest is forgotten first

    def __init__(self):
        self._lock = threading.Lock()
        self._seen = {}  # id key -> sequence number of the newest cancel naming it
        self._running = None  # (id key, sequence number, Event) of the running call

    def seen(self, key, seq):
        with self._lock:
            self._seen.pop(key, None)
            if len(self._seen) >= self.LIMIT:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = seq
            running = self._running
            if running is not None and running[0] == key and running[1] < seq:
                running[2].set()

    def start(self, msg_id, seq):
        """The Event of a tools/call about to run, or None when it was
        cancelled while it waited in line."""
        key = id_key(msg_id)
        event = threading.Event()
        with self._lock:
            if self._seen.get(key, -1) > seq:
                return None
            self._running = (key, seq, event)
        return event

    def finish(self):
        with self._lock:
            self._running = None

    def busy(self):
        """True while a tools/call runs."""
        return self._running is not None


class Server:
    """Maps JSON-RPC messages to Checkpoints calls."""

    def __init__(self, checkpoints, log, send=None):
        self.cp = checkpoints
        self.log = log
        self.send = send  # writes a notification to the client (None: none are sent)
        self.cancels = Cancels()
        self.methods = {
            "initialize": self.initialize,
            "server/discover": self.discover,
            "ping": lambda params: {},
            "tools/list": self.tools_list,
            "tools/call": self.tools_call,
        }

    def initialize(self, params):
        requested = params.get("protocolVersion") if isinstance(params, dict) else None
        version = requested if requested in PROTOCOL_VERSIONS else LATEST_PROTOCOL
        return {"protocolVersion": version,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": SERVER_NAME, "version": tc.__version__},
                "instructions": INSTRUCTIONS}

    def discover(self, params):
        """What a client of the handshake-free revisions asks first."""
        return {"supportedVersions": list(ENVELOPE_VERSIONS),
                "capabilities": {"tools": {"listChanged": False}},
                "instructions": INSTRUCTIONS, "ttlMs": 0, "cacheScope": "private"}

    def tools_list(self, params):
        cursor = params.get("cursor") if isinstance(params, dict) else None
        if cursor is not None:  # the list comes whole, so no cursor was ever given out
            raise RpcError(INVALID_PARAMS, "invalid cursor %s: tools/list is not paged"
                           % json.dumps(cursor)[:40])
        return {"tools": [{"name": name, "title": tool.hints.title,
                           "description": tool.description,
                           "inputSchema": tool.input, "outputSchema": tool.output,
                           "annotations": tool.hints.annotations()}
                          for name, tool in TOOLS.items()]}

    def tools_call(self, params):
        if not isinstance(params, dict):
            raise RpcError(INVALID_PARAMS, "tools/call needs params with a tool name")
        name = params.get("name")
        if name is None:
            raise RpcError(INVALID_PARAMS, "tools/call needs params.name, the tool to run; "
                                           "tools/list names the ten tools")
        if not isinstance(name, str) or name not in TOOLS:
            raise RpcError(INVALID_PARAMS, "unknown tool %s; tools/list names the ten tools"
                           % brief(name))
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return tool_result("arguments must be an object, got %s" % describe_json(arguments),
                               is_error=True)
        schema = TOOLS[name].input
        problems = check_arguments(arguments, schema)
        if problems:
            return tool_result("invalid arguments for %s: %s" % (name, "; ".join(problems)),
                               is_error=True)
        token = progress_token(params)
        if token is None or self.send is None:
            return self.run_tool(name, normalized(arguments, schema))
        with Heartbeat(self.send, token, name, tc.cancel_event()):
            return self.run_tool(name, normalized(arguments, schema))

    def run_tool(self, name, arguments):
        self.remember_root(arguments.get("root"))
        try:
            result = TOOLS[name].handler(self.cp, arguments)
        except tc.CheckpointError as exc:
            return tool_result(one_line(str(exc)), is_error=True)
        except OSError as exc:
            advice = tc.OS_ERROR_ADVICE.get(exc.errno)
            message = "%s could not finish: %s. %s" % (
                name, tc.describe_os_error(exc),
                advice or "Fix the cause (disk space, permissions, a damaged store) and retry.")
            if advice is None:
                self.log("%s: %s" % (name, tc.traceback_text()))
            else:
                self.log(message)
            return tool_result(message, is_error=True)
        self.remember_store(result)
        return tool_result(fit_result(name, result))

    def remember_root(self, root):
        """Log into the store of root (what a call there logs lands in its
        server.log, whichever tool it is); nothing when root names none."""
        if isinstance(root, str):
            with contextlib.suppress(tc.CheckpointError, OSError, ValueError):
                self.remember_store({"store": self.cp.store_directory(root)})

    def remember_store(self, result):
        store = result.get("store") if isinstance(result, dict) else None
        if isinstance(store, str) and store not in self.log.store_dirs:
            self.log.store_dirs[:] = [store]

    def handle_line(self, raw, seq=None):
        """One input line -> the response object, or None for a notification
        (and for a cancelled call). seq: the line's number from the reader."""
        if too_many_values(raw):
            msg_id = unread_request_id(raw)
            if msg_id is None:  # no request whose id can be told: nothing to answer
                self.log("ignored a line of more than %d values and no id that can be read"
                         % VALUE_LIMIT)
                return None
            return error_response(msg_id, INVALID_REQUEST, "request holds more than %d "
                                  "values; it was not read" % VALUE_LIMIT)
        try:
            message = load_message(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            return error_response(None, PARSE_ERROR, "parse error: %s; send one JSON-RPC "
                                  "message per line" % parse_problem(exc))
        if isinstance(message, list):
            return error_response(None, INVALID_REQUEST, "batches are not supported; send "
                                  "one request per line")
        if not isinstance(message, dict):
            return error_response(None, INVALID_REQUEST, "a request must be a JSON object")
        try:
            return self.handle_message(message, seq)
        except Exception as exc:  # a fault outside every handler: answered, and served on
            self.log("internal error: %s" % tc.traceback_text())
            msg_id = message.get("id")
            if "id" not in message:
                return None
            return error_response(msg_id if valid_id(msg_id) else None, INTERNAL_ERROR,
                                  "internal error: %s (details in server.log)"
                                  % type(exc).__name__)

    def handle_message(self, message, seq=None):
        """The response to one parsed message, or None for a notification or a
        response. A request whose id is not one valid_id accepts (null, a
        fraction) gets -32600 with a null id and is not run."""
        has_id = "id" in message
        msg_id = message.get("id")
        method = message.get("method")
        if not isinstance(method, str):
            if "result" in message or "error" in message:
                return None  # a response to nothing we asked
            return error_response(msg_id if valid_id(msg_id) else None, INVALID_REQUEST,
                                  "a request needs a string 'method'")
        if message.get("jsonrpc") != "2.0":
            return error_response(msg_id if valid_id(msg_id) else None, INVALID_REQUEST,
                                  "not a JSON-RPC 2.0 request")
        if has_id and not valid_id(msg_id):
            return error_response(None, INVALID_REQUEST, "a request id must be a string or "
                                  "an integer, not %s" % json.dumps(msg_id)[:40])
        params = message.get("params", {})
        handler = self.methods.get(method)
        if not has_id:
            # Notifications are never answered; a request method sent without
            # an id (a client bug) is not run, so it cannot change anything.
            if handler is not None:
                self.log("ignored %r sent as a notification (it needs an id)" % method)
            return None
        try:
            # The envelope is checked first, whatever the method.
            enveloped = method != "initialize" and enveloped_version(params)
            if handler is None:
                raise RpcError(METHOD_NOT_FOUND, "method %s not found" % brief(method))
            if params is not None and not isinstance(params, (dict, list)):
                raise RpcError(INVALID_PARAMS, "params must be an object")
            if method == "tools/call" and seq is not None:
                result = self.cancellable_call(handler, params or {}, msg_id, seq)
                if result is None:
                    return None
            else:
                result = self.dispatch(handler, params or {}, method)
        except RpcError as exc:
            return error_response(msg_id, exc.code, exc.message, exc.data)
        if enveloped or method == "server/discover":
            result = envelope_result(method, result)
        return {"jsonrpc": "2.0", "id": msg_id, "result": result}

    def cancellable_call(self, handler, params, msg_id, seq):
        """A tools/call that a notifications/cancelled can stop; None when it
        was cancelled (what it did is logged: nothing, or all of it)."""
        name = params.get("name") if isinstance(params, dict) else None
        event = self.cancels.start(msg_id, seq)
        if event is None:
            self.log("tools/call %r (id %r) was cancelled before it started" % (name, msg_id))
            return None
        try:
            with tc.cancellable(event):
                result = self.dispatch(handler, params, "tools/call")
        finally:
            self.cancels.finish()
        if not event.is_set():
            return result
        content = result.get("content") if isinstance(result, dict) else None
        outcome = content[0].get("text", "") if content else ""
        self.log("tools/call %r (id %r) was cancelled; it %s: %s" % (
            name, msg_id, "stopped" if result.get("isError") else "had finished",
            outcome[:300]))
        return None

    def dispatch(self, handler, params, method):
        try:
            return handler(params)
        except RpcError:
            raise
        except Exception as exc:  # the one place an unexpected fault is turned into -32603
            self.log("internal error in %s: %s" % (method, tc.traceback_text()))
            raise RpcError(INTERNAL_ERROR, "internal error in %s: %s (details in server.log)"
                           % (method, type(exc).__name__)) from None


def enveloped_version(params):
    """The protocol version a request of a handshake-free revision names in
    params._meta, or None for a request of the handshake revisions (whose
    _meta, if any, has no version key). An envelope that is incomplete or
    names a revision this server does not speak is refused: without a
    client capabilities object (CAPABILITIES_KEY), -32602; with a version not in
    ENVELOPE_VERSIONS, -32022 whose data.supported lists the envelope and
    the handshake versions, so that a client can fall back to initialize."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict) or VERSION_KEY not in meta:
        return None
    version = meta[VERSION_KEY]
    if not isinstance(meta.get(CAPABILITIES_KEY), dict):
        raise RpcError(INVALID_PARAMS, "params._meta names a protocol version, so it needs "
                       "%r as an object" % CAPABILITIES_KEY)
    if not isinstance(version, str):
        raise RpcError(INVALID_PARAMS, "params._meta[%r] must be a string" % VERSION_KEY)
    if version not in ENVELOPE_VERSIONS:
        raise RpcError(UNSUPPORTED_VERSION,
                       "protocol version %r is not supported; use %s, or the initialize "
                       "handshake" % (version[:64], ", ".join(ENVELOPE_VERSIONS)),
                       {"supported": list(ENVELOPE_VERSIONS + PROTOCOL_VERSIONS),
                        "requested": version[:256]})
    return version


def envelope_result(method, result):
    """A result as the handshake-free revisions have it: marked complete, the
    server named in _meta, cache hints on the tool list."""
    result = dict(result, resultType="complete")
    result["_meta"] = dict(result.get("_meta") or {}, **{SERVER_INFO_KEY: {
        "name": SERVER_NAME, "version": tc.__version__}})
    if method == "tools/list":
        result.update(ttlMs=0, cacheScope="private")
    return result


def valid_id(value):
    """What MCP takes as a request id: a string or an integer (a number with
    no fraction), never null."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (str, int)) or (isinstance(value, float) and value.is_integer())


def reject_constant(name):
    """NaN and Infinity are not JSON. A number too large for a double (1e400)
    is, and reads as infinite: no id or argument takes it, so it is refused
    by name like any other wrong value."""
    raise ValueError("%s is not JSON" % name)


INT_DIGITS_LIMIT = 4000  # under Python's own limit on converting digits to an int


def read_int(digits):
    """An integer of the request; one of more digits than Python converts
    reads as infinite, so it is refused by name like 1e400, not as a parse
    error."""
    return int(digits) if len(digits) <= INT_DIGITS_LIMIT else float(digits)


def parse_problem(exc):
    """What is wrong with a line load_message refused, in a few words."""
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 (byte %d)" % exc.start
    if isinstance(exc, json.JSONDecodeError):
        return "not valid JSON (%s at column %d)" % (exc.msg, exc.colno)
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    text = one_line(str(exc))[:80]
    return text or "not valid JSON"


def load_message(raw):
    """One request line (bytes) parsed as JSON; ValueError when it is not."""
    return json.loads(raw.decode("utf-8"), parse_constant=reject_constant, parse_int=read_int)


def one_line(text):
    return " ".join(text.split())


def error_response(msg_id, code, message, data=None):
    error = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": msg_id, "error": error}


def encode(message):
    """One UTF-8 line; text that UTF-8 cannot carry (lone surrogates) is escaped."""
    try:
        text = json.dumps(message, ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(message, allow_nan=False).encode("ascii") + b"\n"
    except (TypeError, ValueError, RecursionError):
        text = json.dumps(error_response(message.get("id"), INTERNAL_ERROR,
                                         "result could not be encoded"))
        return text.encode("utf-8") + b"\n"


class Inbox:
    """Lines read ahead of the one being handled; END after the last.

    The reader waits for room before it queues a line, so what is held is
    at most INBOX_BYTES and INBOX_LINES plus the one line it read last,
    however long. Cancels are not held: the reader acts on them at once,
    and reads on to the next line while the queue is full."""

    END = object()

    def __init__(self):
        self._cond = threading.Condition()
        self._lines = collections.deque()
        self._bytes = 0

    def wait_for_room(self):
        with self._cond:
            while self._bytes >= INBOX_BYTES or len(self._lines) >= INBOX_LINES:
                self._cond.wait()

    def put(self, item):
        size = len(item[1]) if isinstance(item, tuple) and item[1] else 0
        with self._cond:
            self._lines.append(item)
            self._bytes += size
            self._cond.notify_all()

    def empty(self):
        with self._cond:
            return not self._lines

    def get(self):
        with self._cond:
            while not self._lines:
                self._cond.wait()
            item = self._lines.popleft()
            if isinstance(item, tuple) and item[1]:
                self._bytes -= len(item[1])
            self._cond.notify_all()
            return item


class PromptReplies:
    """Answers the reader thread hands off (pings), written by a thread of
    their own: the reader never waits on stdout, so a client that writes
    before it reads still has its cancels seen. At most LIMIT wait; past
    that a ping takes its turn in the inbox."""

    LIMIT = 16

    def __init__(self, send):
        self._send = send
        self._cond = threading.Condition()
        self._waiting = collections.deque()
        self._thread = None
        self._gone = False

    def offer(self, response):
        """Queue response to be written; False when too many already wait."""
        with self._cond:
            if self._gone:
                return True  # the client stopped reading: nothing more is written
            if len(self._waiting) >= self.LIMIT:
                return False
            self._waiting.append(response)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="replies", daemon=True)
                self._thread.start()
        return True

    def _run(self):
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                response = self._waiting[0]
            try:
                self._send(response)
            except Exception:  # the client is gone (or the line cannot go): stop writing
                with self._cond:
                    self._gone = True
                    self._waiting.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._waiting.popleft()
                self._cond.notify_all()

    def drain(self, timeout):
        """Wait up to timeout seconds for what is queued to be written."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting and not self._gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)


def ping_request(raw):
    """The message of a line that is a ping request, else None."""
    if len(raw) > CANCEL_LINE_LIMIT or not may_name(raw, b'"ping"', b"ping"):
        return None
    try:
        message = load_message(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if (not isinstance(message, dict) or message.get("method") != "ping"
            or message.get("jsonrpc") != "2.0" or not valid_id(message.get("id"))):
        return None
    return message


def read_ahead(instream, inbox, cancels, answer=None):
    """The reader thread: every line into the inbox as (sequence number, line),
    cancellations noted on the way; END when the input ends or fails.

    A ping that arrives while a tools/call runs, with nothing queued before
    it, is handed to answer(message) at once: the protocol asks for a prompt
    reply, and a client that pings to see whether the server is alive must
    not give up on it during a long init or import. answer returns False
    when it cannot take it (too many replies wait); the ping then waits its
    turn like any request."""
    try:
        for seq, raw in enumerate(read_lines(instream, LINE_LIMIT)):
            key = cancelled_request(raw) if raw is not None else None
            if key is not None:
                cancels.seen(key, seq)  # a notification: nothing else is done with it
                continue
            if answer is not None and raw is not None and cancels.busy() and inbox.empty():
                message = ping_request(raw)
                if message is not None and answer(message):
                    continue
            inbox.wait_for_room()
            inbox.put((seq, raw))
    except (OSError, ValueError):
        pass
    finally:
        inbox.put(Inbox.END)


def read_lines(instream, limit):
    """The lines of instream; None in place of a line longer than limit, whose
    bytes are skipped up to its end without being kept."""
    while True:
        line = instream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = instream.readline(1 << 20)
        yield None


def serve(instream, outstream, checkpoints=None, log=None):
    """Serve until instream ends. Streams are binary."""
    log = log or Logger()
    if checkpoints is None:
        for problem in tc.Config.problems():
            log(problem)
        checkpoints = tc.Checkpoints(tc.Config.from_env(), log=log)
    lock = threading.Lock()

    def send(message):
        data = encode(message)
        with lock:
            outstream.write(data)
            outstream.flush()

    server = Server(checkpoints, log, send)
    inbox = Inbox()
    replies = PromptReplies(send)

    def answer(message):
        response = server.handle_message(message)
        return response is None or replies.offer(response)

    threading.Thread(target=read_ahead, args=(instream, inbox, server.cancels, answer),
                     name="stdin", daemon=True).start()
    checkpoints.start_watcher()
    try:
        while True:
            item = inbox.get()
            if item is Inbox.END:
                break
            seq, raw = item
            if raw is None:
                response = error_response(None, INVALID_REQUEST, "request line longer than "
                                          "%d MiB; it was not read" % (LINE_LIMIT >> 20))
            elif not raw.strip():
                continue
            else:
                response = server.handle_line(raw.strip(), seq)
            if response is not None:
                send(response)
    finally:
        replies.drain(2.0)  # pings answered out of turn, still on their way
        checkpoints.stop_watcher()
    return 0


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def skill_path():
    """Where SKILL.md is: beside a checkout, beside this module, or in the
    wheel's data (under the environment's prefix, the user base, or, for
    `pip install --target DIR`, DIR itself)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(os.path.dirname(here), "SKILL.md"),
                  os.path.join(here, "SKILL.md"),
                  os.path.join(sys.prefix, "share", SERVER_NAME, "SKILL.md"),
                  os.path.join(here, "share", SERVER_NAME, "SKILL.md")]
    user_base = getattr(__import__("site"), "USER_BASE", None)
    if user_base:
        candidates.append(os.path.join(user_base, "share", SERVER_NAME, "SKILL.md"))
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    return None


def install_skill(directory, force):
    source = skill_path()
    if source is None:
        print("error: SKILL.md is not installed with this copy of %s" % SERVER_NAME,
              file=sys.stderr)
        return 1
    directory = os.path.abspath(os.path.expanduser(directory))
    target = os.path.join(directory, "SKILL.md")
    if os.path.exists(target) and not force:
        print("error: %s already exists; add --force to overwrite it" % target, file=sys.stderr)
        return 1
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        os.makedirs(directory, exist_ok=True)
        with open(source, "rb") as fh:
            tc.atomic_write(target, fh.read())
        try:  # as cp would leave it, not the temp file's 0600; some mounts refuse
            os.chmod(target, 0o666 & ~umask)
        except OSError:
            pass
    except OSError as exc:
        print("error: cannot write %s: %s" % (target, tc.describe_os_error(exc)),
              file=sys.stderr)
        return 1
    print("installed %s" % target)
    return 0


def build_parser():
    import argparse  # only for a command line with options
    commands = "\n".join("  %-10s %s" % item for item in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="tc-mcp", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tc-mcp [options] | tc-mcp COMMAND [--root DIR] [--json] ...",
        description="task-checkpoint-mcp: checkpoints for long agent tasks, as a stdio MCP "
                    "server.\nWith no argument it serves MCP on stdin/stdout.",
        epilog="commands (tc-mcp COMMAND --help for each; --root DIR: the workspace, by "
               "default the current\ndirectory; --json: the matching tool's result, whole; "
               "exit status 0 done, 1 refused or\nfailed, 2 bad usage):\n%s\n\n"
               "environment: TC_STORE, TC_WATCH, TC_WATCH_INTERVAL, TC_WATCH_EVENTS,\n"
               "TC_DRIFT_MAX_WAIT, TC_GIT, TC_GIT_VERIFY, TC_SHA_REUSE, TC_FULL_HASH, "
               "TC_WORK_THREADS,\nTC_GITIGNORE, TC_STORE_BUDGET (see the README)." % commands)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--print-skill", action="store_true", help="print SKILL.md and exit")
    parser.add_argument("--skill-path", action="store_true",
                        help="print where SKILL.md is installed and exit")
    parser.add_argument("--install-skill", metavar="DIR",
                        help="copy SKILL.md into DIR (a skill directory) and exit")
    parser.add_argument("--force", action="store_true",
                        help="with --install-skill: overwrite an existing SKILL.md")
    return parser


SWITCHES = ("--version", "--print-skill", "--skill-path", "--force", "--help")
OPTIONS = SWITCHES + ("--install-skill",)


def parse_known(parser, argv):
    """parser.parse_known_args, raising ValueError where argparse would
    print an error and exit (-hx, -help: the short -h with more letters)."""
    def refuse(message):
        raise ValueError(message)
    parser.error = refuse
    return parser.parse_known_args(argv)


def split_switch_values(argv):
    """(argv, unknown): a switch given a value (--version=2), which argparse
    would stop on, is an unrecognised argument like any other."""
    kept, unknown = [], []
    for arg in argv:
        (unknown if arg.partition("=")[0] in SWITCHES and "=" in arg else kept).append(arg)
    return kept, unknown


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        if stdin_is_terminal():  # a person typed the command; a client gives it pipes
            print("tc-mcp: an MCP server, waiting for a client on stdin/stdout; "
                  "`tc-mcp --help` lists the commands", file=sys.stderr)
        return run_stdio()
    if argv[0] == "hook":
        return run_hook(argv[1:])
    if argv[0] in COMMANDS:
        return run_command(argv)
    argv, odd = split_switch_values(argv)
    try:
        args, unknown = parse_known(build_parser(), argv)
    except ValueError as exc:
        if any(arg.partition("=")[0] in OPTIONS for arg in argv):  # a person's command
            print("tc-mcp: %s" % exc, file=sys.stderr)
            return 2
        args, unknown = build_parser().parse_known_args([])[0], argv
    unknown = odd + unknown
    if unknown and stdin_is_terminal():  # a person's typo, not a client's extra argument
        build_parser().print_usage(sys.stderr)
        print("tc-mcp: unrecognised argument(s): %s; `tc-mcp --help` lists the commands"
              % " ".join(unknown), file=sys.stderr)
        return 2
    if unknown:
        print("tc-mcp: ignoring unrecognised argument(s): %s" % " ".join(unknown),
              file=sys.stderr)
    if args.version:
        print("%s %s" % (SERVER_NAME, tc.__version__))
        return 0
    if args.skill_path or args.print_skill:
        path = skill_path()
        if path is None:
            print("error: SKILL.md is not installed with this copy", file=sys.stderr)
            return 1
        if args.skill_path:
            print(path)
        else:
            with open(path, encoding="utf-8") as fh:
                sys.stdout.write(fh.read())
        return 0
    if args.install_skill:
        return install_skill(args.install_skill, args.force)
    return run_stdio()


def stdin_is_terminal():
    try:
        return os.isatty(sys.stdin.fileno())
    except (OSError, ValueError, AttributeError):  # no stdin, or one without a descriptor
        return False


def run_stdio():
    """Serve on the real stdio; anything printed by accident goes to stderr.

    The reader thread gets a stream of its own on a copy of stdin's
    descriptor: were it blocked in sys.stdin's buffer when the server stops
    (Ctrl-C, a client that went away), Python could not close that buffer
    at exit and would abort."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    try:
        instream = open(os.dup(sys.stdin.fileno()), "rb")
    except (OSError, ValueError, AttributeError):  # no stdin at all: nothing to serve
        instream = open(os.devnull, "rb")
    try:
        return serve(instream, out)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return 0


# ---------------------------------------------------------------------------
# Commands for people: the operations the tools run, printed as text
# ---------------------------------------------------------------------------

# name -> one line for --help; each runs the same handler its tool has.
COMMANDS = {
    "status": "the task's handoff, the store's health and size",
    "log": "the steps, newest first (--drift: with the drift records and their labels)",
    "show": "one step: its record and its files",
    "diff": "step N against the workspace now, or against step M (--stat: counts only)",
    "restore": "restore a step or drift record (or PATHs of it): a preview, --apply to do it",
    "undo": "restore the last recovered record (undo the last restore): preview, --apply",
    "capture": "record the workspace's changes now (--label TEXT names the moment)",
    "export": "write a handoff package into DIR (--history: every step)",
    "import": "continue a task from a handoff package",
    "usage": "where the store's space goes, and what the budget reclaimed",
    "compress": "reclaim old drift content (--keep-seconds N, --dry-run)",
    "hook": "for client hooks: `hook session-start`, `hook capture` (see the README)",
}
PAGE = 200  # tc_show's largest page: a command reads every page
UNITS = ("B", "KB", "MB", "GB", "TB")


class UsageError(Exception):
    """Arguments the tool's schema refuses: exit status 2, as for argparse."""


class Quiet:
    """A stream that keeps nothing: the log of a command goes to the store's server.log only."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass


def command_parser():
    import argparse
    parser = argparse.ArgumentParser(
        prog="tc-mcp", allow_abbrev=False,
        description="Commands for people on the store of a workspace, beside the MCP server "
                    "(safe while one runs on the same store). Each runs what the matching "
                    "tool runs. Exit status: 0 done, 1 refused or failed, 2 bad usage.")
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--root", metavar="DIR",
                        help="the workspace (default: the current directory, or the "
                             "workspace folder above it that has the task)")
    common.add_argument("--json", action="store_true",
                        help="print the result object of the matching tool, whole: unlike "
                             "the server's, no list or text in it is cut")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    def add(name, *arguments):
        sub = commands.add_parser(name, parents=[common], help=COMMANDS[name],
                                  description=COMMANDS[name], allow_abbrev=False)
        for flags, options in arguments:
            sub.add_argument(*flags, **options)

    number = {"type": step_number, "metavar": "N"}
    add("status")
    add("log", (["--drift"], {"action": "store_true", "help": "list the drift records too"}))
    add("show", (["index"], dict(number, help="the step number")))
    add("diff", (["index"], dict(number, help="the step number")),
        (["other"], {"type": int, "metavar": "M", "nargs": "?",
                     "help": "another step: what changed from N to M; left out: what "
                             "restoring N would change in the workspace now"}),
        (["--stat"], {"action": "store_true", "help": "counts of lines per file only"}))
    add("restore", (["target"], {"metavar": "TARGET", "nargs": "?",
                                 "help": "a step number (3 or s0003), or a drift id such as "
                                         "d0007"}),
        (["paths"], {"nargs": "*", "metavar": "PATH",
                     "help": "only these workspace paths (files or folders)"}),
        (["--apply"], {"action": "store_true", "help": "change the workspace"}))
    add("undo", (["--apply"], {"action": "store_true", "help": "change the workspace"}))
    add("capture", (["--label"], {"metavar": "TEXT", "help": "a few words naming the moment"}))
    add("export", (["to"], {"metavar": "DIR", "help": "an existing directory"}),
        (["--history"], {"action": "store_true", "help": "include every step"}))
    add("import", (["package"], {"metavar": "PACKAGE", "help": "the package directory"}))
    add("usage")
    add("compress", (["--keep-seconds"], {"type": int, "metavar": "N", "dest": "keep_seconds",
                                          "help": "keep drift content younger than this "
                                                  "(default 604800, a week)"}),
        (["--dry-run"], {"action": "store_true", "dest": "dry_run",
                         "help": "report what would go; delete nothing"}))
    return parser


STEP_NUMBER = re.compile(r"s?([0-9]+)")
# What a terminal would act on in an agent's words: controls (but newline and
# tab), line and paragraph separators, and the marks that reorder text.
UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f"
                         "\u2028-\u202e\u2066-\u2069\ufeff]")


def printable(text):
    """text as a terminal should get it: the characters UNPRINTABLE names
    shown as escapes, so no title or conclusion can move the cursor, change
    colours or pass for a line of its own."""
    return UNPRINTABLE.sub(lambda m: ("\\x%02x" if ord(m.group()) < 0x100 else "\\u%04x")
                           % ord(m.group()), text)


def step_number(text):
    """A step number as a person may give it: 3, or s0003 as refs and
    targets spell it."""
    match = STEP_NUMBER.fullmatch(text.strip())
    if match is None:
        import argparse
        raise argparse.ArgumentTypeError("invalid step number %r (give 3, or s0003)" % text)
    return int(match.group(1))


def run_command(argv):
    """A command for people; its exit status."""
    args = command_parser().parse_args(argv)  # bad usage: argparse exits with 2
    for problem in tc.Config.problems():
        print("tc-mcp: %s" % problem, file=sys.stderr)
    log = Logger(Quiet())
    cp = tc.Checkpoints(tc.Config.from_env(), log=log)
    try:
        root = (os.path.abspath(os.path.expanduser(args.root)) if args.root
                else enclosing_workspace(cp, os.getcwd()))
        with contextlib.suppress(tc.CheckpointError, OSError, ValueError):
            log.store_dirs[:] = [cp.store_directory(root)]
        result, text = RUNNERS[args.command](cp, root, args)
        note = result.get("note") if isinstance(result, dict) else None
        if note and text and note.strip() not in text:
            text = text.rstrip("\n") + "\n\nnote: " + note.strip()
    except UsageError as exc:
        print("tc-mcp %s: %s" % (args.command, exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what was under way stops as after a kill: the store recovers
        return 130
    except Exception as exc:  # noqa: BLE001 (every failure is one line, never a traceback)
        print("tc-mcp %s: %s" % (args.command, printable(failure_text(args.command, exc, log))),
              file=sys.stderr)
        return 1
    if args.json:
        text = json.dumps(result, ensure_ascii=False, indent=2)
    if text:
        try:
            sys.stdout.write(printable(text.rstrip("\n")) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # `tc-mcp log | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def failure_text(what, exc, log):
    """The one line a failed command or hook says about exc."""
    if isinstance(exc, tc.CheckpointError):
        return one_line(str(exc))
    if isinstance(exc, OSError):
        advice = tc.OS_ERROR_ADVICE.get(exc.errno)
        return "could not finish: %s%s" % (tc.describe_os_error(exc),
                                           ". " + advice if advice else "")
    log("internal error in %s: %s" % (what, tc.traceback_text()))
    return "internal error: %s (details in the store's server.log)" % type(exc).__name__


def enclosing_workspace(cp, start):
    """start, or the nearest folder above it that is a workspace with an
    active task in its store: a command or hook run in a subfolder acts on
    its project. start itself when there is none (the error then names it).
    A stat or two a level; the active pointer is read only where a store is."""
    start = os.path.realpath(start)
    folder = start
    while True:
        try:
            store_dir = cp.store_directory(folder)
            if (os.path.isfile(os.path.join(store_dir, "current.json"))
                    and cp.workspaces.store(store_dir).read_current().get(folder)):
                return folder
        except (tc.CheckpointError, OSError):
            pass
        parent = os.path.dirname(folder)
        if parent == folder:
            return start
        folder = parent


def call_tool(cp, name, **arguments):
    """A tool run as tools/call runs it: the arguments checked against its
    input schema (what it refuses is bad usage) and its defaults filled in;
    the result comes back whole."""
    schema = TOOLS[name].input
    problems = check_arguments(arguments, schema)
    if problems:
        raise UsageError("; ".join(problems))
    return TOOLS[name].handler(cp, normalized(arguments, schema))


def all_pages(cp, root, **arguments):
    """tc_show's result with every page read: its lists joined, no next cursor."""
    cursor, result = 0, None
    while True:
        page = call_tool(cp, "tc_show", root=root, limit=PAGE, cursor=cursor, **arguments)
        if result is None:
            result = page
        else:
            result["drifts"] += page["drifts"]
            if arguments.get("index") is not None:
                result["steps"][0]["files"] += page["steps"][0].get("files", [])
            else:
                result["steps"] += page["steps"]
        cursor = page["next_cursor"]
        if cursor is None:
            return result
        result["next_cursor"] = None


def size_text(count):
    size, unit = float(count or 0), 0
    while size >= 1024 and unit < len(UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return "%d %s" % (size, UNITS[unit]) if unit == 0 else "%.1f %s" % (size, UNITS[unit])


def age_text(created):
    """'5m ago' for an ISO time in UTC (as records have it); '' when there is none."""
    try:
        import calendar  # only for the command line's ages
        seconds = time.time() - calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError):
        return ""
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return "%d%s ago" % (seconds // length, unit)
    return "%ds ago" % max(seconds, 0)


def first_line(text, width=70):
    line = (text or "").strip().split("\n", 1)[0].strip()
    return line if len(line) <= width else line[:width - 1] + "…"


def columns(rows):
    """rows of cells as lines, each column as wide as its widest cell (the last left ragged)."""
    widths = [max(len(row[i]) for row in rows if len(row) > i) for i in range(max(map(len, rows)))]
    return ["  ".join(cell.ljust(widths[i]) if i < len(row) - 1 else cell
                      for i, cell in enumerate(row)).rstrip() for row in rows]


def run_status(cp, root, args):
    result = call_tool(cp, "tc_resume", root=root)
    lines = [result["handoff"], ""]
    health = result["health"]
    lines.append("health: ok" if health["ok"] else "health: %d problem(s)" % len(health["errors"]))
    lines += ["  - %s" % one_line(error) for error in health["errors"]]
    try:
        usage = call_tool(cp, "tc_compress", root=root, dry_run=True)["usage"]
        size = "%s in all, %s of it content" % (size_text(usage["total_bytes"]),
                                                size_text(usage["content_bytes"]))
    except (tc.CheckpointError, OSError) as exc:
        size = "size unknown (%s)" % one_line(str(exc))
    lines.append("store: %s (%s)" % (result["store"], size))
    lines.append("task: %s (%s)" % (result.get("task_id"), result.get("status")))
    return result, "\n".join(lines)


def step_row(step):
    if step.get("damaged"):
        return ["%d" % step["index"], "", "(damaged: %s)" % first_line(step["damaged"])]
    title = first_line(step.get("title"), 50)
    if step.get("agent"):
        title += " by %s" % first_line(step["agent"], 40)
    title += " (head)" if step.get("head") else ""
    conclusion = first_line(step.get("conclusion"))
    return ["%d" % step["index"], age_text(step.get("created")),
            title + ("  — " + conclusion if conclusion else "")]


def drift_row(drift):
    if drift.get("damaged"):
        return [drift["id"], "", "(damaged: %s)" % first_line(drift["damaged"])]
    counts = "+%d ~%d -%d" % tuple(len(drift.get(k) or ()) for k in DRIFT_LISTS)
    kind = drift.get("kind") or ""
    if drift.get("compressed"):
        kind += ", reclaimed"
    label = " %s" % json.dumps(drift["label"], ensure_ascii=False) if drift.get("label") else ""
    if drift.get("agent"):
        label += " by %s" % first_line(drift["agent"], 40)
    return [drift["id"], age_text(drift.get("created")), "%s [%s]%s" % (counts, kind, label)]


def run_log(cp, root, args):
    result = all_pages(cp, root, include_drift=args.drift)
    items = [(step.get("created_ns") or 0, step_row(step)) for step in result["steps"]]
    items += [(drift.get("created_ns") or 0, drift_row(drift)) for drift in result["drifts"]]
    items.sort(key=lambda item: item[0], reverse=True)  # newest first
    lines = ["task %s (%s), head step %d" % (result["task_id"], result["status"], result["head"])]
    if not items:
        lines.append("no step saved yet")
    else:
        lines += ["  " + line for line in columns([row for _, row in items])]
    return result, "\n".join(lines)


def run_show(cp, root, args):
    result = all_pages(cp, root, index=args.index)
    step = result["steps"][0]
    lines = ["step %d%s  %s  %s" % (step["index"], " (head)" if step.get("head") else "",
                                    step.get("created") or "", age_text(step.get("created")))]
    if step.get("agent"):
        lines.append("agent: %s" % step["agent"])
    for key in ("title", "conclusion", "description", "next"):
        if step.get(key):  # continuation lines indented: none passes for a field of its own
            lines.append("%s: %s" % (key, step[key].rstrip("\n").replace("\n", "\n  ")))
    for key in ("verified", "open_questions"):
        if step.get(key):
            lines.append("%s:" % key.replace("_", " "))
            lines += ["  - %s" % item for item in step[key]]
    if step.get("drift_id"):
        lines.append("recorded with: %s" % step["drift_id"])
    files = step.get("files") or []
    lines.append("files (%d):" % len(files))
    if files:
        lines += ["  " + line for line in columns([[size_text(f["size"]), f["kind"], f["path"]]
                                                   for f in files])]
    return result, "\n".join(lines)


def restore_call(cp, root, target, *, paths=(), apply=False):
    """tc_restore of target (a step number or a drift id): a preview with
    its diff, or with apply the restore itself."""
    arguments = {"root": root, "apply": apply}
    if STEP_NUMBER.fullmatch(target):
        arguments["index"] = step_number(target)
    elif not re.fullmatch(r"d[0-9]+", target):
        raise UsageError("TARGET %r is neither a step number (3, or s0003) nor a drift id "
                         "(d0007)" % target)
    else:
        arguments["drift_id"] = target
    if paths:
        arguments["paths"] = [workspace_path(root, path) for path in paths]
    if not apply:
        arguments["diff"] = True
    return call_tool(cp, "tc_restore", **arguments)


def workspace_path(root, path):
    """A PATH a person typed, as the workspace-relative path tools take: an
    absolute one must lie in the workspace; a relative one is taken from the
    current directory when that lies in the workspace (as git takes it),
    else from the workspace root."""
    here = os.path.realpath(os.getcwd())
    real_root = os.path.realpath(root)
    inside = here == real_root or here.startswith(real_root.rstrip(os.sep) + os.sep)
    full = os.path.join(here if inside else real_root, os.path.expanduser(path))
    full = os.path.normpath(full)
    if full != real_root and not full.startswith(real_root.rstrip(os.sep) + os.sep):
        raise UsageError("PATH %r is outside the workspace %s" % (path, root))
    rel = os.path.relpath(full, real_root)
    if rel == os.curdir:
        raise UsageError("PATH %r is the whole workspace: leave PATH out to restore all of "
                         "it" % path)
    return rel.replace(os.sep, "/")


def diff_text(entries, stat):
    """A restore's or a step's diff entries as unified diff text, or with
    stat as a line of counts per file."""
    if not entries:
        return "no difference"
    if stat:
        rows = [[entry["path"], "+%s -%s" % (entry.get("added") or 0, entry.get("removed") or 0),
                 entry.get("change") or "", entry.get("reason") or ""] for entry in entries]
        added = sum(entry.get("added") or 0 for entry in entries)
        removed = sum(entry.get("removed") or 0 for entry in entries)
        return "\n".join(columns(rows) + ["%d file(s), +%d -%d" % (len(entries), added,
                                                                  removed)])
    parts = []
    for entry in entries:
        if entry.get("patch"):
            parts.append(entry["patch"].rstrip("\n"))
        else:
            parts.append("%s: %s%s" % (entry["path"], entry.get("change") or "changed",
                                       " (%s)" % entry["reason"] if entry.get("reason") else ""))
    return "\n".join(parts)


def run_diff(cp, root, args):
    if args.other is None:
        result = restore_call(cp, root, str(args.index))
        header = ("what restoring step %d would change: the workspace now (-), step %d (+):"
                  % (args.index, args.index))
    else:
        result = cp.steps_diff(root, args.index, args.other)
        header = "step %d (-) to step %d (+):" % (args.index, args.other)
    return result, header + "\n" + diff_text(result.get("diff") or [], args.stat)


def plan_lines(result):
    plan = result["plan"]
    lines = ["  %d to write, %d to replace, %d to delete" % (
        len(plan["to_write"]), len(plan["to_replace"]), len(plan["to_delete"]))]
    lines += ["  left alone: %s (%s)" % (item["path"], item["reason"])
              for item in plan["unrestorable"] + result.get("skipped_paths", [])]
    return lines


def restore_text(result, what):
    if not result["applied"]:
        lines = ["preview of restoring %s (nothing changed; --apply does it):" % what]
        lines += plan_lines(result)
        if result.get("plan_id"):
            lines.append("  plan id: %s" % result["plan_id"])
        if result.get("diff") is not None:
            lines += ["", diff_text(result["diff"], False)]
        return "\n".join(lines)
    lines = ["restored %s:" % what] + plan_lines(result)
    if result.get("note"):
        lines += ["", result["note"].rstrip("\n"), ""]
    lines.append("recovered: %s (tc-mcp undo --apply puts the workspace back as it was)"
                 % result["recovered"])
    return "\n".join(lines)


def run_restore(cp, root, args):
    if args.target is None:
        raise UsageError("restore needs TARGET: a step number (3 or s0003) or a drift id "
                         "(d0007), then any PATHs to restore only those")
    result = restore_call(cp, root, args.target, paths=args.paths, apply=args.apply)
    target = args.target
    what = ("step %d" % step_number(target) if STEP_NUMBER.fullmatch(target) else target) + (
        " (%s)" % ", ".join(args.paths) if args.paths else "")
    return result, restore_text(result, what)


def last_recovered(cp, root):
    """The newest drift record a restore or import wrote (kind "recovered")."""
    drifts = all_pages(cp, root, include_drift=True)["drifts"]
    for drift in reversed(drifts):
        if drift.get("kind") == "recovered" and not drift.get("damaged"):
            return drift["id"]
    raise tc.NotFound("nothing to undo: no restore or import has recorded what it replaced "
                      "in this task")


def run_undo(cp, root, args):
    drift_id = last_recovered(cp, root)
    result = restore_call(cp, root, drift_id, apply=args.apply)
    return result, restore_text(result, "%s (what the last restore replaced)" % drift_id)


def run_capture(cp, root, args):
    arguments = {"label": args.label} if args.label is not None else {}
    result = call_tool(cp, "tc_capture", root=root, **arguments)
    if not result["captured"]:
        return result, "nothing changed since the last record"
    text = "recorded %s: %d added, %d modified, %d deleted" % (
        result["drift_id"], len(result["added"]), len(result["modified"]),
        len(result["deleted"]))
    if args.label:
        text += " (%s)" % args.label
    if result["partial"]:
        text += "\nsome files were still changing; the record may be partial"
    return result, text


def run_export(cp, root, args):
    result = call_tool(cp, "tc_export", root=root, to=os.path.abspath(args.to),
                       history=args.history)
    lines = ["wrote %s (%d files)" % (result["path"], len(result["files"]))]
    lines += ["  left out: %s (%s)" % (item["path"], item["reason"]) for item in result["filtered"]]
    if result.get("changed_since_step"):
        lines.append("  not in the package, changed since the step: %s (save first to include "
                     "them)" % ", ".join(result["changed_since_step"][:10]))
    return result, "\n".join(lines)


def run_import(cp, root, args):
    result = call_tool(cp, "tc_import", root=root, package=os.path.abspath(args.package))
    text = "task %s is active in %s" % (result["task_id"], root)
    if result.get("recovered"):
        text += ("\nfiles it overwrote are kept in %s (tc-mcp restore %s --apply brings them "
                 "back)" % (result["recovered"], result["recovered"]))
    return result, text


def usage_lines(usage, store):
    lines = ["store %s: %s in all, %s of it content (%d files)" % (
        store, size_text(usage["total_bytes"]), size_text(usage["content_bytes"]),
        usage.get("content_files", 0)),
        "  held only by drift records: %s; a compress with --keep-seconds 0 frees %s" % (
            size_text(usage["drift_only_bytes"]), size_text(usage["freed_at_keep_seconds_0"]))]
    rows = [["task %s" % task["task_id"], "(%s)" % task.get("status"),
             "%d steps, %d drift records" % (task["steps"], task["drifts"]),
             "records %s, content %s" % (size_text(task["record_bytes"]),
                                         size_text(task["content_bytes"])),
             task.get("root") or ""] for task in usage["tasks"]]
    lines += ["  " + line for line in columns(rows)] if rows else []
    budget = usage.get("budget") or {}
    if budget.get("bytes"):
        lines.append("budget (TC_STORE_BUDGET): %s, %s; reclaimed so far: %d drift record(s), "
                     "%s%s" % (size_text(budget["bytes"]),
                               "over it: steps and the newest records alone need more"
                               if budget.get("over") else "kept",
                               budget.get("reclaimed_records", 0),
                               size_text(budget.get("reclaimed_bytes", 0)),
                               ", last at %s" % budget["last_reclaimed"]
                               if budget.get("last_reclaimed") else ""))
    else:
        lines.append("budget: none (TC_STORE_BUDGET is not set)")
    return lines


def run_usage(cp, root, args):
    result = call_tool(cp, "tc_compress", root=root, dry_run=True)
    return result, "\n".join(usage_lines(result["usage"], cp.store_directory(root)))


def run_compress(cp, root, args):
    arguments = {"dry_run": args.dry_run}
    if args.keep_seconds is not None:
        arguments["keep_seconds"] = args.keep_seconds
    result = call_tool(cp, "tc_compress", root=root, **arguments)
    lines = ["%s %s from %d drift record(s) (%d old copies eligible, %d already gone, %d "
             "unreferenced file(s))" % (
                 "would reclaim" if result["dry_run"] else "reclaimed",
                 size_text(result["bytes_freed"]), result["converted"], result["eligible"],
                 result["already_gone"], result["unreferenced"])]
    lines += usage_lines(result["usage"], cp.store_directory(root))
    return result, "\n".join(lines)


RUNNERS = {"status": run_status, "log": run_log, "show": run_show, "diff": run_diff,
           "restore": run_restore, "undo": run_undo, "capture": run_capture,
           "export": run_export, "import": run_import, "usage": run_usage,
           "compress": run_compress}


# ---------------------------------------------------------------------------
# Client hooks: never block or break the session that runs them
# ---------------------------------------------------------------------------

HOOK_SECONDS = 4.0  # then a hook gives up and exits 0: its client waits for it
HOOK_LOCK_SECONDS = 1.0  # ... and this long for a store another process holds
HOOK_INPUT_LIMIT = 16 * 1024 * 1024  # bytes of the event read from stdin
SHELL_TOOLS = ("bash", "shell")  # the shell tool's name, as Claude Code and Codex send it
RESUME_HINT = ("task-checkpoint: this workspace has an open task (above). Call tc_resume "
               "(root %s) before you start, and tc_save after each finished step.")


def run_hook(argv):
    """`tc-mcp hook NAME`, fed the client's event as JSON on stdin. Always
    exit status 0 (a client takes 2 as "block the tool"), at most one line
    on stderr, and done within HOOK_SECONDS: past that it exits at once,
    wherever it is (a restore holding the lock, a huge first snapshot). The
    store is built to be left at any point, as after a kill."""
    watchdog = threading.Timer(HOOK_SECONDS, give_up)
    watchdog.daemon = True
    watchdog.start()
    name = argv[0] if len(argv) == 1 else None
    if name not in HOOKS:
        say_once("tc-mcp hook: expected `hook session-start` or `hook capture`, got %s"
                 % " ".join(argv))
        return 0
    log = Logger(Quiet())
    try:
        event, problem = read_event()
        cp = tc.Checkpoints(tc.Config.from_env(), log=log, lock_timeout=HOOK_LOCK_SECONDS)
        cwd = event.get("cwd")
        start = cwd if isinstance(cwd, str) and os.path.isabs(cwd) and os.path.isdir(cwd) \
            else os.getcwd()
        root = enclosing_workspace(cp, start)
        with contextlib.suppress(tc.CheckpointError, OSError, ValueError):
            log.store_dirs[:] = [cp.store_directory(root)]
        HOOKS[name](cp, root, event)
        if problem:
            say_once("tc-mcp hook %s: %s" % (name, problem))
    except (tc.NotFound, tc.TaskClosed):
        pass  # no open task here: nothing to say and nothing to record
    except Exception as exc:  # noqa: BLE001 (a hook never fails its session)
        say_once("tc-mcp hook %s: %s" % (name, failure_text("hook " + name, exc, log)))
    sys.stdout.flush()
    return 0


def give_up():
    say_once("tc-mcp hook: stopped after %g s (the store is busy or the workspace is large); "
             "it recovers at its next use" % HOOK_SECONDS)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(0)


def say_once(line):
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(one_line(line) + "\n")
        sys.stderr.flush()


def read_event():
    """(the event object on stdin, or {}; what was wrong with it, or None).
    No stdin, a terminal or empty input is no event, and no problem."""
    try:
        if sys.stdin is None or os.isatty(sys.stdin.fileno()):
            return {}, None
        raw = sys.stdin.buffer.read(HOOK_INPUT_LIMIT + 1)
    except (OSError, ValueError, AttributeError):
        return {}, None
    if not raw.strip():
        return {}, None
    try:
        event = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        event = None
    if not isinstance(event, dict):
        return {}, "stdin is not a JSON object; the current directory was used"
    return event, None


def hook_label(event):
    """The event's name, its tool, and a shell tool's command on one line:
    "PreToolUse Bash: rm -rf build", at most tc.LABEL_LIMIT characters."""
    name = event.get("hook_event_name")
    label = name if isinstance(name, str) and name.strip() else "hook"
    tool = event.get("tool_name")
    if isinstance(tool, str) and tool.strip():
        label += " " + tool
        tool_input = event.get("tool_input")
        command = tool_input.get("command") if isinstance(tool_input, dict) else None
        if isinstance(command, list):
            command = " ".join(str(part) for part in command)
        if tool.lower() in SHELL_TOOLS and isinstance(command, str) and command.strip():
            label += ": " + one_line(command)[:tc.LABEL_LIMIT]
    return one_line(label)[:tc.LABEL_LIMIT]


def hook_session_start(cp, root, event):
    """The open task's handoff on stdout, which Claude Code and Codex add to
    the model's context at the start of a session; nothing otherwise."""
    result = cp.resume(root)
    if result.get("status") != "open":
        return
    sys.stdout.write(result["handoff"].rstrip("\n") + "\n\n" + RESUME_HINT % root + "\n")


def hook_capture(cp, root, event):
    """The workspace's changes as a drift record labelled with the event; prints nothing."""
    cp.capture(root, label=hook_label(event))


HOOKS = {"session-start": hook_session_start, "capture": hook_capture}


if __name__ == "__main__":
    sys.exit(main())
