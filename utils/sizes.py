"""The size rules, once: every notebook's `check_sizes` is built from these two functions.

One rule for every size a notebook takes: a bool or a float where an int belongs is a TypeError, an
int out of range a ValueError, and both name the parameter and its value. They fail before any
process starts, so a bad `parameters` cell never reaches a rank.
"""
import operator


def check_int(name, value, minimum=1):
    """`value` as an int, if it is one and at least `minimum`."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if operator.index(value) < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return operator.index(value)


def divide(total_name, total, parts_name, parts, why):
    """total // parts, when `parts` divides `total` (CS336's int_divide); else a ValueError naming both and `why`."""
    total, parts = check_int(total_name, total), check_int(parts_name, parts)
    if total % parts:
        raise ValueError(f"{total_name.replace('_', ' ')} {total} is not divisible by "
                         f"{parts_name.replace('_', ' ')} {parts}: {why}")
    return total // parts
