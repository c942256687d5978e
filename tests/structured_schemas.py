"""50 varied JSON schemas for the constrained-decoding tests: nested objects, arrays with bounds,
enums, numbers with ranges, anyOf, optional fields, tuples, patterns and string formats. Strings
are bounded: a random-weight model would never close an unbounded one."""

import random

FORMATS = ["date", "uuid", "ipv4"]  # bounded lengths: a random model would never end an email


def leaf(rng, depth):
    kind = rng.choice(["int", "num", "str", "enum", "bool", "fmt", "const", "null", "pattern"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "num":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "str":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a b"], rng.randint(1, 4))}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "fmt":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if kind == "null":
        return {"type": "null"}
    return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^\d{3}-\d{4}$", r"^(yes|no)$"])}


def node(rng, depth):
    if depth >= 3:
        return leaf(rng, depth)
    kind = rng.choice(["leaf", "leaf", "object", "array", "anyOf", "tuple"])
    if kind == "leaf":
        return leaf(rng, depth)
    if kind == "object":
        return obj(rng, depth + 1)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": node(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    if kind == "tuple":
        return {"type": "array", "prefixItems": [leaf(rng, depth) for _ in range(rng.randint(1, 3))], "items": False}
    return {"anyOf": [node(rng, depth + 1) for _ in range(rng.randint(2, 3))]}


def obj(rng, depth):
    names = rng.sample(["id", "name", "size", "tags", "when", "ok", "pos", "kind", "note", "meta"], rng.randint(1, 4))
    props = {n: node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n=50, seed=0):
    rng = random.Random(seed)
    return [obj(rng, 0) for _ in range(n)]
