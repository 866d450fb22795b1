"""The harness inside the user process: runs the program, then each call into it, and reports the
values as plain data on the results descriptor, each line with the run's nonce.

A value crosses only as builtin data (tagged JSON); an object of the program's own is not data
and its test fails, except where the test uses only its truth value (``assert f(x)``,
``not``/``and``/``or``), where ``bool(value)`` crosses: the program could have returned that bool.
"""
import errno
import os
import sys

LIMIT_ERRNOS = {errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.ENOMEM}


def run_tests(program: str, setup: str, leaves: list, fd: int, nonce: str) -> None:
    """Run the program and the setup, then evaluate each test's calls into the program and report
    their values. ``leaves``: per test, [source, truth_only] per call.

    Everything used after the program has run is bound here first: a program that replaces
    builtins.exec, compile, bool, json or os functions, or rebinds this module's globals, changes
    nothing the harness does. It can still make its own functions return anything: that is its answer."""
    from json.encoder import c_make_encoder, encode_basestring_ascii

    exec_, eval_, compile_, write, flush = exec, eval, compile, os.write, (sys.stdout.flush, sys.stderr.flush)
    len_, str_encode, join, enumerate_, BaseException_, truth = len, str.encode, "".join, enumerate, BaseException, bool
    kind_of_, describe_ = kind_of, describe
    # The C encoder alone (json.dumps's Python layers are patchable); its input below holds only
    # exact builtin types, so it calls no Python code.
    dumps = c_make_encoder(None, None, encode_basestring_ascii, None, ":", ",", False, False, True)
    encode = make_encoder()

    def send(**event):
        event["n"] = nonce
        data = str_encode(join(dumps(event, 0)) + "\n")
        while data:
            data = data[write(fd, data):]

    # __name__ is not "__main__", so a program's `if __name__ == "__main__":` demo code does not run.
    scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        calls = [[(compile_(src, f"<test {i}>", "eval"), truth_only) for src, truth_only in test]
                 for i, test in enumerate_(leaves)]
        exec_(compile_(program, "<program>", "exec"), scope)
        if setup:
            exec_(compile_(setup, "<test setup>", "exec"), scope)
    except BaseException_ as e:  # SystemExit too: the program must not end the harness
        send(e="program", ok=False, kind=kind_of_(e), msg=describe_(e))
        return
    finally:
        for f in flush:
            f()
    send(e="program", ok=True)
    for i, test in enumerate_(calls):
        try:
            values = [truth(eval_(code, scope)) if truth_only else eval_(code, scope) for code, truth_only in test]
            encoded = encode(values)  # may meet an object lying about its __class__: not data either
        except BaseException_ as e:
            send(e="test", i=i, kind=kind_of_(e), msg=describe_(e))
            continue
        if encoded is None:
            send(e="test", i=i, kind="error", msg="a returned value is not plain data (or too large or deep)")
        else:
            send(e="test", i=i, v=encoded)
    for f in flush:
        f()
    send(e="done", count=len_(leaves))


def make_encoder(max_nodes: int = 200_000, max_depth: int = 64):
    """encode(value) -> plain JSON data, or None when the value is not builtin data or too big.

    Tagged so that Python equality survives the trip: lists stay JSON arrays; tuples, sets,
    frozensets, dicts, bytes, complex and big ints become {"T": tag, "v": ...}. Subclasses of
    builtin types are read through the base type's own methods (an overridden __iter__ or
    __eq__ is never called); any other object is not data: None. Iterative: no recursion to exhaust."""
    type_, len_, hex_, list_, enumerate_ = type, len, hex, list, enumerate
    dict_items, set_iter, fz_iter, list_copy = dict.items, set.__iter__, frozenset.__iter__, list.copy
    tuple_get, int_int, float_float, str_str = tuple.__getitem__, int.__int__, float.__float__, str.__str__
    bytes_hex, bytearray_hex, isinstance_ = bytes.hex, bytearray.hex, isinstance
    real, imag = complex.real.__get__, complex.imag.__get__
    full = slice(None)
    big = 1 << 53

    def encode(value):
        root = [None]
        todo = [(value, root, 0, 0)]  # (object, output container, index in it, depth)
        nodes = 0
        while todo:
            obj, out, at, depth = todo.pop()
            nodes += 1
            if nodes > max_nodes or depth > max_depth:
                return None
            t = type_(obj)
            items = None
            if obj is None or t is bool or t is str:
                out[at] = obj
            elif isinstance_(obj, int):
                n = int_int(obj)
                out[at] = n if -big < n < big else {"T": "int", "v": hex_(n)}
            elif isinstance_(obj, float):
                out[at] = float_float(obj)
            elif isinstance_(obj, str):
                out[at] = str_str(obj)
            elif isinstance_(obj, complex):
                out[at] = {"T": "complex", "v": [real(obj), imag(obj)]}
            elif isinstance_(obj, (bytes, bytearray)):
                out[at] = {"T": "bytes", "v": (bytes_hex if isinstance_(obj, bytes) else bytearray_hex)(obj)}
            elif isinstance_(obj, list):
                items = list_copy(obj)
                out[at] = node = [None] * len_(items)
            elif isinstance_(obj, tuple):
                items = tuple_get(obj, full)
                node = [None] * len_(items)
                out[at] = {"T": "tuple", "v": node}
            elif isinstance_(obj, (set, frozenset)):
                items = list_((set_iter if isinstance_(obj, set) else fz_iter)(obj))
                node = [None] * len_(items)
                out[at] = {"T": "set" if isinstance_(obj, set) else "frozenset", "v": node}
            elif isinstance_(obj, dict):
                pairs = list_(dict_items(obj))
                node = [None] * (2 * len_(pairs))
                items = [x for pair in pairs for x in pair]
                out[at] = {"T": "dict", "v": node}
            else:  # not data (an object with its own methods): the test fails
                return None
            if items is not None:
                todo.extend((item, node, k, depth + 1) for k, item in enumerate_(items))
        return root[0]
    return encode


def kind_of(exc: BaseException) -> str:
    """fail (assertion), limit (a resource limit was hit) or error (anything else)."""
    if isinstance(exc, AssertionError):
        return "fail"
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in LIMIT_ERRNOS):
        return "limit"
    return "error"


def describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except BaseException:  # a hostile __str__
        return "an exception whose description failed"


