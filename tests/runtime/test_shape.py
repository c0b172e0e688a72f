import pytest

from monarch_cli.runtime.actor.shape import Shape, ValueMesh


def test_row_major_points_and_ranks():
    shape = Shape({"hosts": 2, "gpus": 3})
    points = list(shape.points())
    assert [p.rank for p in points] == list(range(6))
    assert dict(points[4]) == {"hosts": 1, "gpus": 1}
    assert shape.rank_of({"hosts": 1, "gpus": 2}) == 5


def test_select_ints_drop_dims_and_slices_keep_them():
    shape = Shape({"hosts": 2, "gpus": 4})
    sub, ranks = shape.select(hosts=1)
    assert sub.extent == {"gpus": 4} and ranks == [4, 5, 6, 7]
    sub, ranks = shape.select(gpus=slice(0, 4, 2))
    assert sub.extent == {"hosts": 2, "gpus": 2} and ranks == [0, 2, 4, 6]
    sub, ranks = shape.select(hosts=-1, gpus=slice(1, None))
    assert sub.extent == {"gpus": 3} and ranks == [5, 6, 7]


@pytest.mark.parametrize(
    "dims, error",
    [
        ({"racks": 0}, KeyError),
        ({"gpus": 4}, IndexError),
        ({"gpus": slice(9, 10)}, IndexError),
        ({"gpus": "1"}, TypeError),
    ],
)
def test_bad_selections_say_what_is_wrong(dims, error):
    with pytest.raises(error):
        Shape({"hosts": 2, "gpus": 4}).select(**dims)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        Shape({"gpus": 0})
    with pytest.raises(ValueError):
        Shape({"not a name": 1})


def test_value_mesh_items_values_item():
    vm = ValueMesh(Shape({"hosts": 2, "gpus": 2}), ["a", "b", "c", "d"])
    assert vm.item(hosts=1, gpus=0) == "c"
    assert vm.values() == ["a", "b", "c", "d"]
    assert [(dict(p), v) for p, v in vm.items()][1] == ({"hosts": 0, "gpus": 1}, "b")
    with pytest.raises(KeyError):
        vm.item(hosts=1)
