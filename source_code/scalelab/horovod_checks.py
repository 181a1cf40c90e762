"""Checks of a student's Horovod conversion of ``fashion_mnist.py`` (lab 3), for the notebook's graded cells.

Two kinds of evidence:

- **structure**: the script is parsed with :mod:`ast` (never run, never string-matched) and each conversion step
  is looked for where it must be: ``hvd.init()`` before the model is built, the optimizer given to ``compile``
  wrapped in ``hvd.DistributedOptimizer``, ``BroadcastGlobalVariablesCallback(0)`` in the callbacks given to
  ``fit``, ``MetricAverageCallback`` before every callback that reads the metrics, checkpoints and printing on
  rank 0 only, the learning rate multiplied by ``hvd.size()``, the steps per epoch divided by it;
- **behaviour**: :func:`run_two_ranks` trains the script for one short epoch under ``horovodrun -np 2`` and
  compares the final weights the two ranks wrote (``--weights-digest-dir``): identical only when the initial
  weights were broadcast and the gradients averaged.

``check(script, step)`` raises an AssertionError that says what is missing and why it matters; ``problems``
returns the same sentences as a list. ``thorough=False`` only asks whether the step was started (the graded
cells' visible part); the hidden tests ask for it done right. Names are resolved the way a reader follows a
top-to-bottom script: an import alias to its module (``hvd`` → ``horovod.tensorflow.keras``), a variable to the
assignments that reach the line where it is used.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STEPS = ("init", "pin_device", "rank0_output", "scaled_lr", "distributed_optimizer", "broadcast",
         "metric_average", "rank0_checkpoint", "steps_per_epoch", "cli")
# The serial script's options: a converted script keeps them, so the grader can run it like the serial one.
SERIAL_OPTIONS = ("--batch-size", "--val-batch-size", "--epochs", "--base-lr", "--momentum", "--warmup-epochs",
                  "--target-accuracy", "--patience", "--wd", "--train-images", "--val-images", "--output-dir",
                  "--seed", "--weights-digest-dir")
# Callbacks that read the epoch's metrics: under Horovod they must see the averaged ones.
METRIC_READERS = ("ReduceLROnPlateau", "EarlyStopping", "ModelCheckpoint", "StopAtAccuracy", "EpochPrinter",
                  "CSVLogger", "CSVTimeLog", "TensorBoard")
# The course's callbacks that print unless told they are not on the chief: (name, position of is_chief).
PRINTING_CALLBACKS = {"EpochPrinter": 1, "TotalTime": 0, "StopAtAccuracy": 3}
LR_ARGUMENT_NAMES = ("learning_rate", "initial_learning_rate", "peak_lr", "base_lr", "lr", "initial_lr")


class Script:
    """A parsed script with import aliases and variable assignments indexed."""

    def __init__(self, source: str, name: str = "<script>"):
        self.name = name
        self.tree = ast.parse(source, filename=name)
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.aliases: dict[str, str] = {}
        self.assignments: dict[str, list[tuple[ast.stmt, ast.expr]]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        self.aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self._index(target, node.value, node)
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                self._index(node.target, node.value, self.statement(node))
            elif isinstance(node, ast.AugAssign):
                # `x *= e` is `x = x * e`; the x on the right is the value before this statement.
                before = copy.deepcopy(node.target)
                for part in ast.walk(before):
                    if hasattr(part, "ctx"):
                        part.ctx = ast.Load()
                value = ast.copy_location(ast.BinOp(before, node.op, node.value), node)
                for part in ast.walk(before):
                    for child in ast.iter_child_nodes(part):
                        self.parent[child] = part
                self.parent[before] = self.parent[value] = node
                self._index(node.target, value, node)

    @classmethod
    def from_path(cls, path: Path | str) -> "Script":
        path = Path(path)
        return cls(path.read_text(), str(path))

    def _index(self, target: ast.expr, value: ast.expr, statement: ast.stmt) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and \
                len(value.elts) == len(target.elts) else [value] * len(target.elts)
            for element, element_value in zip(target.elts, values):
                self._index(element, element_value, statement)
            return
        key = dotted(target)
        if key is not None:
            self.assignments.setdefault(key, []).append((statement, value))

    # ---------------------------------------------------------------------- names

    def statement(self, node: ast.AST) -> ast.stmt:
        while not isinstance(node, ast.stmt):
            node = self.parent[node]
        return node

    def qualname(self, expr: ast.AST) -> str | None:
        """``hvd.callbacks.MetricAverageCallback`` → ``horovod.tensorflow.keras.callbacks.MetricAverageCallback``."""
        name = dotted(expr)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        origin = self.aliases.get(head, head)
        return f"{origin}.{rest}" if rest else origin

    def definitions(self, expr: ast.expr) -> list[ast.expr]:
        """The values assigned to the variable ``expr`` names that can reach its use: the assignments above it,
        back to the last one made unconditionally at the top level of the script."""
        key = dotted(expr)
        if key is None or not isinstance(getattr(expr, "ctx", None), ast.Load):
            return []
        used_at = self.statement(expr).lineno
        found = []
        for statement, value in sorted(self.assignments.get(key, []), key=lambda pair: -pair[0].lineno):
            if statement.lineno >= used_at:
                continue
            found.append(value)
            if isinstance(self.parent.get(statement), ast.Module):
                break
        return found

    def resolved_nodes(self, expr: ast.AST, seen: set | None = None):
        """Every node of ``expr``, and of the values its variables were given, recursively."""
        seen = set() if seen is None else seen
        if id(expr) in seen:
            return
        seen.add(id(expr))
        for node in ast.walk(expr):
            yield node
            if isinstance(node, (ast.Name, ast.Attribute)):
                for value in self.definitions(node):
                    yield from self.resolved_nodes(value, seen)

    def values(self, expr: ast.expr, seen: set | None = None) -> list[ast.expr]:
        """What ``expr`` stands for: itself unless it is a variable, else the values that reach it (recursively)."""
        seen = set() if seen is None else seen
        if id(expr) in seen:
            return []
        seen.add(id(expr))
        definitions = self.definitions(expr) if isinstance(expr, (ast.Name, ast.Attribute)) else []
        if not definitions:
            return [expr]
        return [value for definition in definitions for value in self.values(definition, seen)]

    # ---------------------------------------------------------------------- calls

    def calls(self, suffix: str, horovod: bool = False) -> list[ast.Call]:
        return [node for node in ast.walk(self.tree)
                if isinstance(node, ast.Call) and self.is_call(node, suffix, horovod)]

    def is_call(self, node: ast.AST, suffix: str, horovod: bool = False) -> bool:
        if not isinstance(node, ast.Call):
            return False
        name = self.qualname(node.func)
        if name is None:
            return False
        if horovod and not name.startswith("horovod."):
            return False
        return name == suffix or name.endswith("." + suffix)

    def method_calls(self, method: str) -> list[ast.Call]:
        """``x.method(...)`` calls on variables (``model.fit``), not on modules (``np.save``)."""
        return [node for node in ast.walk(self.tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == method
                and (dotted(node.func.value) or "").split(".")[0] not in self.aliases]

    def mentions_horovod(self, expr: ast.AST, function: str) -> bool:
        return any(self.is_call(node, function, horovod=True) for node in self.resolved_nodes(expr))

    def is_horovod(self, expr: ast.AST, function: str) -> bool:
        """``expr`` is ``hvd.<function>()``, maybe through variables or int()/float()."""
        for value in self.values(expr):
            if self.is_call(value, function, horovod=True):
                return True
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("int", "float") \
                    and len(value.args) == 1 and self.is_horovod(value.args[0], function):
                return True
        return False

    # ---------------------------------------------------------------------- rank 0

    def chief_polarity(self, test: ast.expr, seen: set | None = None) -> int:
        """+1 when ``test`` is true on rank 0 only, -1 when true on every rank but 0, 0 when neither is known."""
        seen = set() if seen is None else seen
        if id(test) in seen:
            return 0
        seen.add(id(test))
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return -self.chief_polarity(test.operand, seen)
        if isinstance(test, ast.BoolOp):
            polarities = [self.chief_polarity(value, seen) for value in test.values]
            if isinstance(test.op, ast.And) and 1 in polarities:
                return 1
            if isinstance(test.op, ast.Or) and all(polarity == 1 for polarity in polarities):
                return 1
            return 0
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, right, op = test.left, test.comparators[0], test.ops[0]
            if is_constant(left, 0, 1) and not is_constant(right, 0, 1):
                left, right = right, left
                op = {ast.Gt: ast.Lt(), ast.Lt: ast.Gt(), ast.GtE: ast.LtE(), ast.LtE: ast.GtE()}.get(type(op), op)
            if not self.is_horovod(left, "rank"):
                return 0
            if is_constant(right, 0):
                return {ast.Eq: 1, ast.Is: 1, ast.LtE: 1, ast.NotEq: -1, ast.IsNot: -1, ast.Gt: -1}.get(type(op), 0)
            if is_constant(right, 1):
                return {ast.Lt: 1, ast.GtE: -1}.get(type(op), 0)
            return 0
        if self.is_horovod(test, "rank"):
            return -1          # `if hvd.rank():` is true on every rank but 0
        if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id in ("int", "bool") \
                and len(test.args) == 1:
            return self.chief_polarity(test.args[0], seen)
        if isinstance(test, (ast.Name, ast.Attribute)):
            polarities = {self.chief_polarity(value, seen) for value in self.definitions(test)}
            return polarities.pop() if len(polarities) == 1 else 0
        return 0

    def on_chief_only(self, node: ast.AST) -> bool:
        """``node`` runs on rank 0 only: it sits in the branch of an `if` (or `x if c else y`) that only rank 0
        takes, or after an early exit of the other ranks is not recognised (keep it simple: guard it)."""
        child, ancestor = node, self.parent.get(node)
        while ancestor is not None:
            if isinstance(ancestor, (ast.If, ast.IfExp, ast.While)):
                polarity = self.chief_polarity(ancestor.test)
                in_body = child in ancestor.body if isinstance(ancestor.body, list) else child is ancestor.body
                in_else = child in ancestor.orelse if isinstance(ancestor.orelse, list) else child is ancestor.orelse
                if (in_body and polarity == 1) or (in_else and polarity == -1):
                    return True
            child, ancestor = ancestor, self.parent.get(ancestor)
        return False

    def guarded_by_local_rank(self, node: ast.AST) -> bool:
        ancestor = self.parent.get(node)
        while ancestor is not None:
            if isinstance(ancestor, (ast.If, ast.IfExp)) and self.mentions_horovod(ancestor.test, "local_rank"):
                return True
            ancestor = self.parent.get(ancestor)
        return False

    # ---------------------------------------------------------------------- model, fit, callbacks

    def fit_call(self) -> ast.Call | None:
        calls = self.method_calls("fit")
        return calls[-1] if calls else None

    def compile_call(self) -> ast.Call | None:
        calls = self.method_calls("compile")
        return calls[-1] if calls else None

    def model_built_at(self) -> int | None:
        """The line where the model the script compiles is built (its last assignment before compile)."""
        compile_call = self.compile_call()
        if compile_call is None:
            return None
        definitions = self.definitions(compile_call.func.value)
        if definitions:
            return min(self.statement(value).lineno for value in definitions)
        return self.statement(compile_call).lineno

    def callback_sequence(self, expr: ast.expr, seen: set | None = None) -> list[tuple[ast.expr, ast.AST]]:
        """The callbacks ``expr`` holds, in the order Keras calls them: (the callback's value, where it was put in
        the list — the node whose rank guard counts)."""
        seen = set() if seen is None else seen
        if id(expr) in seen:
            return []
        seen.add(id(expr))
        if isinstance(expr, (ast.List, ast.Tuple)):
            sequence = []
            for element in expr.elts:
                if isinstance(element, ast.Starred):
                    sequence += self.callback_sequence(element.value, seen)
                else:
                    sequence += [(value, element) for value in self.values(element)]
            return sequence
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return self.callback_sequence(expr.left, seen) + self.callback_sequence(expr.right, seen)
        if isinstance(expr, ast.IfExp):
            return self.callback_sequence(expr.body, seen) + self.callback_sequence(expr.orelse, seen)
        if isinstance(expr, (ast.Name, ast.Attribute)):
            definitions = self.definitions(expr)
            sequence = []
            for definition in reversed(definitions):
                sequence += self.callback_sequence(definition, seen)
            defined_at = min((self.statement(value).lineno for value in definitions), default=0)
            used_at = self.statement(expr).lineno
            key = dotted(expr)
            for call in sorted(self.method_calls("append") + self.method_calls("insert") + self.method_calls("extend"),
                               key=lambda call: call.lineno):
                if dotted(call.func.value) != key or not defined_at <= call.lineno < used_at or not call.args:
                    continue
                if call.func.attr == "append":
                    sequence += [(value, call) for value in self.values(call.args[0])]
                elif call.func.attr == "extend":
                    sequence += self.callback_sequence(call.args[0], seen)
                elif len(call.args) == 2:
                    index = call.args[0].value if isinstance(call.args[0], ast.Constant) \
                        and isinstance(call.args[0].value, int) else len(sequence)
                    sequence[index:index] = [(value, call) for value in self.values(call.args[1])]
            return sequence
        return []

    def fit_callbacks(self) -> list[tuple[ast.expr, ast.AST]] | None:
        fit = self.fit_call()
        if fit is None:
            return None
        expr = keyword(fit, "callbacks")
        return [] if expr is None else self.callback_sequence(expr)


def dotted(expr: ast.AST) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = dotted(expr.value)
        return None if inner is None else f"{inner}.{expr.attr}"
    return None


def is_constant(expr: ast.AST, *values) -> bool:
    return isinstance(expr, ast.Constant) and not isinstance(expr.value, bool) and expr.value in values


def keyword(call: ast.Call, name: str, position: int | None = None) -> ast.expr | None:
    for item in call.keywords:
        if item.arg == name:
            return item.value
    if position is not None and len(call.args) > position and not isinstance(call.args[position], ast.Starred):
        return call.args[position]
    return None


def line(node: ast.AST) -> str:
    return f"line {node.lineno}"


# -------------------------------------------------------------------------- the steps

def _check_init(script: Script, thorough: bool) -> list[str]:
    inits = script.calls("init", horovod=True)
    if not any(name.startswith("horovod") for name in script.aliases.values()):
        return ["import Horovod's Keras API (`import horovod.tensorflow.keras as hvd`)"]
    if not inits:
        return ["call hvd.init(): until then the processes horovodrun starts do not know of each other"]
    if not thorough:
        return []
    first_init = min(script.statement(call).lineno for call in inits)
    problems = []
    built = script.model_built_at()
    if built is not None and first_init > built:
        problems.append(f"hvd.init() ({line(inits[0])}) must come before the model is built (line {built}): "
                        "Horovod, its device and its threads are set up first")
    others = [call for name in ("rank", "size", "local_rank", "local_size", "DistributedOptimizer")
              for call in script.calls(name, horovod=True)]
    early = [call for call in others if script.statement(call).lineno < first_init]
    if early:
        problems.append(f"hvd.init() must come before the first use of Horovod ({line(early[0])}): "
                        "rank and size are only known after it")
    if any(script.on_chief_only(call) for call in inits):
        problems.append("every rank calls hvd.init(), not rank 0 only")
    return problems


def _check_pin_device(script: Script, thorough: bool) -> list[str]:
    if not script.calls("local_rank", horovod=True):
        return ["pin each process to its own GPU with its local rank: pin_gpu(hvd.local_rank()) "
                "(from scalelab.runtime)"]
    if not thorough:
        return []
    pins = script.calls("pin_gpu") + script.calls("set_visible_devices")
    if not pins:
        return ["pass hvd.local_rank() to pin_gpu (from scalelab.runtime) or tf.config.set_visible_devices: "
                "without it every rank allocates GPU 0"]
    chosen = [call for call in pins if any(script.mentions_horovod(arg, "local_rank")
                                           for arg in [*call.args, *(item.value for item in call.keywords)])]
    if not chosen:
        if any(script.mentions_horovod(arg, "rank") for call in pins for arg in call.args):
            return ["choose the GPU by hvd.local_rank(), its index on this machine: hvd.rank() counts the ranks "
                    "of all machines, and the second machine has no GPU 8"]
        return ["the GPU a rank uses must come from hvd.local_rank(), a different one on each rank of a machine"]
    problems = []
    built = script.model_built_at()
    pinned_at = min(script.statement(call).lineno for call in chosen)
    if built is not None and pinned_at > built:
        problems.append(f"pin the device ({line(chosen[0])}) before the model is built (line {built}): "
                        "TensorFlow picks its devices when it first runs")
    inits = script.calls("init", horovod=True)
    if inits and pinned_at < min(script.statement(call).lineno for call in inits):
        problems.append("hvd.local_rank() is only known after hvd.init(): pin the device after it")
    if any(script.on_chief_only(call) for call in chosen):
        problems.append("every rank pins its own device, not rank 0 only")
    return problems


def _check_rank0_output(script: Script, thorough: bool) -> list[str]:
    if not script.calls("rank", horovod=True):
        return ["use hvd.rank() to let rank 0 alone print (e.g. `is_chief = hvd.rank() == 0`)"]
    if not thorough:
        return []
    problems = []
    for call in ast.walk(script.tree):
        if not isinstance(call, ast.Call) or _inside_function(script, call):
            continue
        if isinstance(call.func, ast.Name) and call.func.id == "print" and not script.on_chief_only(call):
            problems.append(f"the print() on {line(call)} runs on every rank: guard it with rank 0 "
                            "(`if hvd.rank() == 0:`)")
        if isinstance(call.func, ast.Attribute) and call.func.attr == "summary" and not script.on_chief_only(call):
            problems.append(f"model.summary() on {line(call)} prints on every rank: guard it with rank 0")
    for name, position in PRINTING_CALLBACKS.items():
        for call in script.calls(name):
            chief = keyword(call, "is_chief", position)
            verbose = keyword(call, "verbose", None)
            quiet = verbose is not None and isinstance(verbose, ast.Constant) and not verbose.value
            if script.on_chief_only(call) or quiet or (chief is not None and script.chief_polarity(chief) == 1):
                continue
            problems.append(f"{name}(...) on {line(call)} prints on every rank: pass is_chief=hvd.rank() == 0 "
                            "(or a variable holding it)")
    for method in ("fit", "evaluate", "predict"):
        for call in script.method_calls(method):
            verbose = keyword(call, "verbose")
            if verbose is None:
                problems.append(f"model.{method}() on {line(call)} prints a progress bar on every rank: pass "
                                "verbose=0, or 1 on rank 0 only")
            elif not _quiet_off_chief(script, verbose) and not script.on_chief_only(call):
                problems.append(f"model.{method}(verbose=...) on {line(call)} must be 0 on every rank but 0 "
                                "(e.g. `verbose=1 if hvd.rank() == 0 else 0`)")
    return problems


def _quiet_off_chief(script: Script, verbose: ast.expr) -> bool:
    for value in script.values(verbose):
        if isinstance(value, ast.Constant) and not value.value:
            continue
        if isinstance(value, ast.IfExp):
            polarity = script.chief_polarity(value.test)
            quiet_branch = value.orelse if polarity == 1 else value.body if polarity == -1 else None
            if quiet_branch is not None and _quiet_off_chief(script, quiet_branch):
                continue
        if script.chief_polarity(value) == 1:
            continue
        return False
    return True


def _inside_function(script: Script, node: ast.AST) -> bool:
    ancestor = script.parent.get(node)
    while ancestor is not None:
        if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return True
        ancestor = script.parent.get(ancestor)
    return False


def _optimizer_given_to_compile(script: Script) -> ast.expr | None:
    compile_call = script.compile_call()
    return None if compile_call is None else keyword(compile_call, "optimizer", 0)


def _check_distributed_optimizer(script: Script, thorough: bool) -> list[str]:
    wrappers = script.calls("DistributedOptimizer", horovod=True)
    if not wrappers:
        return ["wrap the optimizer in hvd.DistributedOptimizer: it averages the ranks' gradients before each "
                "update"]
    if not thorough:
        return []
    given = _optimizer_given_to_compile(script)
    if given is None:
        return ["compile the model with the optimizer: model.compile(optimizer=..., ...)"]
    values = script.values(given)
    if not all(script.is_call(value, "DistributedOptimizer", horovod=True) for value in values):
        return [f"model.compile() ({line(given)}) is given the plain optimizer: give it the "
                "hvd.DistributedOptimizer that wraps it, or the gradients are never averaged"]
    problems = []
    for wrapper in values:
        inner = keyword(wrapper, "optimizer", 0)
        if inner is None or not all(isinstance(value, ast.Call) and not script.is_call(value, "DistributedOptimizer")
                                    for value in script.values(inner)):
            problems.append(f"hvd.DistributedOptimizer on {line(wrapper)} must wrap the Keras optimizer "
                            "(e.g. the SGD the serial script builds)")
    return problems


def _check_scaled_lr(script: Script, thorough: bool) -> list[str]:
    if not script.calls("size", horovod=True):
        return ["multiply the learning rate by hvd.size(), the number of workers"]
    if not thorough:
        return []
    given = _optimizer_given_to_compile(script)
    if given is None:
        return ["compile the model with the optimizer: model.compile(optimizer=..., ...)"]
    optimizers = []
    for value in script.values(given):
        if script.is_call(value, "DistributedOptimizer", horovod=True):
            inner = keyword(value, "optimizer", 0)
            optimizers += script.values(inner) if inner is not None else []
        else:
            optimizers.append(value)
    rates = [rate for optimizer in optimizers if isinstance(optimizer, ast.Call)
             for rate in [keyword(optimizer, "learning_rate", 0)] if rate is not None]
    if not rates:
        return ["give the optimizer its learning rate explicitly (learning_rate=...), scaled by hvd.size()"]
    if not all(_scaled_by_size(script, rate, set()) for rate in rates):
        other_rule = next((keyword(call, "rule", 2) for rate in rates for call in script.resolved_nodes(rate)
                           if script.is_call(call, "scaled_learning_rate") and keyword(call, "rule", 2) is not None),
                          None)
        if other_rule is not None:
            return [f"scale the learning rate linearly (rule=\"linear\", the default), not {ast.unparse(other_rule)}: "
                    "the lab's rule multiplies it by hvd.size()"]
        return [f"the optimizer's learning rate ({line(rates[0])}) is not multiplied by hvd.size(): one update "
                "now averages size batches, so the linear scaling rule takes size times larger steps"]
    return []


def _scaled_by_size(script: Script, expr: ast.expr, seen: set) -> bool:
    if id(expr) in seen:
        return False
    seen.add(id(expr))
    if isinstance(expr, (ast.Name, ast.Attribute)):
        return any(_scaled_by_size(script, value, seen) for value in script.definitions(expr))
    if isinstance(expr, ast.BinOp):
        if isinstance(expr.op, ast.Mult) and (script.is_horovod(expr.left, "size")
                                              or script.is_horovod(expr.right, "size")):
            return True
        if isinstance(expr.op, (ast.Div, ast.FloorDiv)):
            return _scaled_by_size(script, expr.left, seen)
        return _scaled_by_size(script, expr.left, seen) or _scaled_by_size(script, expr.right, seen)
    if isinstance(expr, ast.Call):
        if script.is_call(expr, "scaled_learning_rate"):
            workers = keyword(expr, "workers", 1)
            rule = keyword(expr, "rule", 2)
            return workers is not None and script.is_horovod(workers, "size") and \
                (rule is None or (isinstance(rule, ast.Constant) and rule.value == "linear"))
        # A schedule: its rate is its first argument or a keyword that names a rate (not steps_per_epoch).
        candidates = [expr.args[0]] if expr.args else []
        candidates += [item.value for item in expr.keywords if item.arg in LR_ARGUMENT_NAMES]
        return any(_scaled_by_size(script, candidate, seen) for candidate in candidates)
    return False


def _horovod_callbacks(script: Script, name: str) -> tuple[list[ast.Call], list | None]:
    return script.calls(name, horovod=True), script.fit_callbacks()


def _check_broadcast(script: Script, thorough: bool) -> list[str]:
    created, callbacks = _horovod_callbacks(script, "BroadcastGlobalVariablesCallback")
    if not created:
        return ["add hvd.callbacks.BroadcastGlobalVariablesCallback(0) to the callbacks: every rank must start "
                "from rank 0's initial weights"]
    if not thorough:
        return []
    if callbacks is None:
        return ["train with model.fit(..., callbacks=...)"]
    given = [(value, placed) for value, placed in callbacks
             if script.is_call(value, "BroadcastGlobalVariablesCallback", horovod=True)]
    if not given:
        return ["the BroadcastGlobalVariablesCallback is not in the callbacks given to model.fit()"]
    problems = []
    for value, placed in given:
        root = keyword(value, "root_rank", 0)
        if root is None or not is_constant(root, 0):
            problems.append(f"broadcast from rank 0 (BroadcastGlobalVariablesCallback(0), {line(value)}): "
                            "rank 0's weights are the ones every rank starts from")
        if script.on_chief_only(placed) or script.on_chief_only(value):
            problems.append("every rank takes part in the broadcast: add the callback on all ranks, not rank 0 "
                            "only (the others would wait for it forever)")
    return problems


def _check_metric_average(script: Script, thorough: bool) -> list[str]:
    created, callbacks = _horovod_callbacks(script, "MetricAverageCallback")
    if not created:
        return ["add hvd.callbacks.MetricAverageCallback() to the callbacks: metrics averaged over the ranks"]
    if not thorough:
        return []
    if callbacks is None:
        return ["train with model.fit(..., callbacks=...)"]
    positions = [index for index, (value, _) in enumerate(callbacks)
                 if script.is_call(value, "MetricAverageCallback", horovod=True)]
    if not positions:
        return ["the MetricAverageCallback is not in the callbacks given to model.fit()"]
    problems = []
    if any(script.on_chief_only(callbacks[index][1]) or script.on_chief_only(callbacks[index][0])
           for index in positions):
        problems.append("every rank takes part in averaging the metrics: add MetricAverageCallback on all ranks")
    for index, (value, _) in enumerate(callbacks):
        reader = next((name for name in METRIC_READERS if script.is_call(value, name)), None)
        if reader is not None and index < positions[0]:
            problems.append(f"MetricAverageCallback must come before {reader} ({line(value)}) in the callback "
                            f"list: Keras calls callbacks in order, so {reader} would read this rank's own metrics")
    return problems


def _check_rank0_checkpoint(script: Script, thorough: bool) -> list[str]:
    checkpoints = script.calls("ModelCheckpoint")
    saves = [call for method in ("save", "save_weights") for call in script.method_calls(method)]
    if not checkpoints and not saves:
        return ["keep the checkpoints (ModelCheckpoint), written by rank 0"]
    if not script.calls("rank", horovod=True):
        return ["let rank 0 alone write checkpoints (hvd.rank() == 0)"]
    if not thorough:
        return []
    problems = []
    for call in checkpoints + saves:
        if script.on_chief_only(call):
            continue
        if script.guarded_by_local_rank(call):
            problems.append(f"the checkpoint on {line(call)} is written by local rank 0 of every machine: "
                            "guard it with hvd.rank() == 0")
        else:
            problems.append(f"the checkpoint on {line(call)} is written by every rank: only rank 0 writes "
                            "(`if hvd.rank() == 0: callbacks.append(ModelCheckpoint(...))`); two writers can "
                            "leave a corrupt file")
    callbacks = script.fit_callbacks() or []
    if checkpoints and not any(script.is_call(value, "ModelCheckpoint") for value, _ in callbacks):
        problems.append("the ModelCheckpoint is not in the callbacks given to model.fit() (on rank 0)")
    return problems


def _check_steps_per_epoch(script: Script, thorough: bool) -> list[str]:
    fit = script.fit_call()
    steps = None if fit is None else keyword(fit, "steps_per_epoch")
    if steps is None:
        return ["pass steps_per_epoch to model.fit(): the data set repeats, so it sets the epoch's length"]
    if not thorough:
        return [] if script.calls("size", horovod=True) else ["divide the steps per epoch by hvd.size()"]
    problems = []
    if not any(_divided_by_size(script, node) for node in script.resolved_nodes(steps)):
        problems.append("divide the steps per epoch by hvd.size(): all ranks together go through the data once "
                        "an epoch, each rank 1/size of it (N / (batch x size) steps)")
    if any(script.is_call(node, name, horovod=True) for node in script.resolved_nodes(steps)
           for name in ("rank", "local_rank")):
        problems.append("every rank must run the same number of steps (an allreduce waits for all ranks): "
                        "compute steps_per_epoch from the whole data set's size, not from this rank's shard")
    return problems


def _divided_by_size(script: Script, node: ast.AST) -> bool:
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, (ast.Div, ast.FloorDiv)):
        return False
    return any(script.is_call(inner, "size", horovod=True) for inner in script.resolved_nodes(node.right))


def _check_cli(script: Script, thorough: bool) -> list[str]:
    options = {arg.value for call in script.method_calls("add_argument") for arg in call.args
               if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
    missing = [option for option in SERIAL_OPTIONS if option not in options]
    return [f"keep the serial script's options (the grader runs your script with them); missing: "
            f"{', '.join(missing)}"] if missing else []


CHECKS = {"init": _check_init, "pin_device": _check_pin_device, "rank0_output": _check_rank0_output,
          "scaled_lr": _check_scaled_lr, "distributed_optimizer": _check_distributed_optimizer,
          "broadcast": _check_broadcast, "metric_average": _check_metric_average,
          "rank0_checkpoint": _check_rank0_checkpoint, "steps_per_epoch": _check_steps_per_epoch, "cli": _check_cli}
assert tuple(CHECKS) == STEPS


def problems(script: Path | str | Script, step: str, thorough: bool = True) -> list[str]:
    """What is missing or misplaced for ``step`` (one of :data:`STEPS`) in the script at ``script``; [] when done."""
    if step not in CHECKS:
        raise ValueError(f"unknown step {step!r}; choose one of {STEPS}")
    if not isinstance(script, Script):
        path = Path(script)
        if not path.is_file():
            return [f"{path.name} is missing: it must be next to this notebook"]
        try:
            script = Script.from_path(path)
        except SyntaxError as error:
            return [f"{path.name} does not parse (line {error.lineno}): {error.msg}"]
    return CHECKS[step](script, thorough)


def check(script: Path | str | Script, step: str, thorough: bool = True) -> None:
    """Raise an AssertionError listing :func:`problems` when there are any."""
    found = problems(script, step, thorough)
    assert not found, f"{step.replace('_', ' ')}: " + "; ".join(found)


# -------------------------------------------------------------------------- the run

@dataclass
class TwoRankRun:
    """A short ``horovodrun -np 2`` run of a script and the weights its ranks ended with."""
    returncode: int
    output: str                                  # the last lines the ranks printed (stdout and stderr)
    records: dict[int, dict] = field(default_factory=dict)   # rank → its weights_rank<r>.json
    same_weights: bool | None = None             # None: fewer than two ranks wrote weights

    @property
    def problems(self) -> list[str]:
        if self.returncode != 0:
            return [f"the two-rank run failed (exit status {self.returncode}); its last lines:\n{self.output}"]
        if 1 not in self.records:
            return ["only one file of weights was written: name the digest files by hvd.rank() "
                    "(weights_rank{hvd.rank()}.npz) so each rank writes its own"]
        sizes = {record.get("size") for record in self.records.values()}
        if sizes != {2}:
            return [f"the ranks report size {sorted(sizes)}, not 2: did hvd.init() run, and is the size "
                    "written from hvd.size()?"]
        if not self.same_weights:
            return ["the two ranks ended with different weights: broadcast rank 0's initial weights "
                    "(BroadcastGlobalVariablesCallback(0)) and average the gradients (hvd.DistributedOptimizer)"]
        return []


def run_two_ranks(script: Path | str, workdir: Path | str | None = None, controller: str = "--gloo",
                  train_images: int = 512, val_images: int = 256, timeout_s: int = 300) -> TwoRankRun:
    """Train ``script`` for one epoch on a few images under ``horovodrun -np 2`` and compare the ranks' weights."""
    import numpy as np

    from .environment import horovodrun_path

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="two_ranks_") as scratch:
            return run_two_ranks(script, scratch, controller, train_images, val_images, timeout_s)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    digests = workdir / "weights"
    for stale in digests.glob("weights_rank*") if digests.is_dir() else []:
        stale.unlink()
    horovodrun = horovodrun_path() or "horovodrun"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("NBGRADER_EXECUTION", None)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # No --seed: the ranks start from different random weights unless the script broadcasts rank 0's.
    command = [horovodrun, "-np", "2", controller, sys.executable, str(Path(script).resolve()),
               "--epochs", "1", "--train-images", str(train_images), "--val-images", str(val_images),
               "--warmup-epochs", "0", "--output-dir", str(workdir / "output"), "--weights-digest-dir", str(digests)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir, timeout=timeout_s)
        returncode, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = 124
        output = f"(stopped after {timeout_s} s) " + (expired.stdout or b"").decode(errors="replace")[-2000:]
    run = TwoRankRun(returncode, "\n".join(output.strip().splitlines()[-15:]))
    for rank in (0, 1):
        record = digests / f"weights_rank{rank}.json"
        if record.is_file():
            run.records[rank] = json.loads(record.read_text())
    if returncode == 0 and len(run.records) == 2:
        with np.load(digests / "weights_rank0.npz") as first, np.load(digests / "weights_rank1.npz") as second:
            run.same_weights = first.files == second.files and \
                all(np.array_equal(first[key], second[key]) for key in first.files)
    return run


def check_two_ranks(script: Path | str, workdir: Path | str | None = None, controller: str = "--gloo") -> TwoRankRun:
    """:func:`run_two_ranks`, raising an AssertionError that explains what went wrong."""
    run = run_two_ranks(script, workdir, controller)
    assert not run.problems, "two ranks: " + "; ".join(run.problems)
    return run
