"""kvgen.oracle.agreement: two address functions compared on every element at once, and the
first element where they differ, in the order the element-by-element walk meets it."""

from __future__ import annotations

from kvgen.oracle.agreement import agree_everywhere, first_difference


def _address(a: int, b: int, c: int) -> tuple[tuple[int], tuple[int, int]]:
    return (a,), (b * 3 + c, 7)


def test_equal_functions_agree_on_grids() -> None:
    assert agree_everywhere((2, 3, 3), _address, lambda a, b, c: ((a,), (c + 3 * b, 7)))
    assert first_difference((2, 3, 3), _address, lambda a, b, c: ((a,), (c + 3 * b, 7))) is None


def test_the_first_difference_in_product_order_is_named() -> None:
    def wrong(a: int, b: int, c: int) -> tuple[tuple[int], tuple[int, int]]:
        return (a,), (b * 3 + c + (a * b == 2) + (a * c == 2), 7)

    assert not agree_everywhere((2, 3, 3), _address, wrong)
    # (1, 0, 2) comes before (1, 2, 0) in product order.
    assert first_difference((2, 3, 3), _address, wrong) == ((1, 0, 2), ((1,), (2, 7)), ((1,), (3, 7)))


def test_a_function_that_cannot_take_grids_is_walked_element_by_element() -> None:
    def branchy(a: int, b: int, c: int) -> tuple[tuple[int], tuple[int, int]]:
        if a == 1 and b == 2 and c == 2:
            return (a,), (0, 7)
        return (a,), (b * 3 + c, 7)

    assert not agree_everywhere((2, 3, 3), _address, branchy)
    assert first_difference((2, 3, 3), _address, branchy) == ((1, 2, 2), ((1,), (8, 7)), ((1,), (0, 7)))
    assert first_difference((2, 3, 2), _address, branchy) is None


def test_shapes_of_addresses_that_differ_are_a_difference() -> None:
    assert not agree_everywhere((2, 2), lambda a, b: ((a,), (b,)), lambda a, b: ((a,), (b, 0)))
    assert first_difference((2, 2), lambda a, b: ((a,), (b,)), lambda a, b: ((a,), (b, 0)))[0] == (0, 0)
