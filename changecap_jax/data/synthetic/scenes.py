"""Scenes, changes and captions of the synthetic change dataset (CLEVR-Change style).

Each example is a "before" scene of 3 to 7 objects and two "after" views of it:

* the semantic after: one change of type color, material, add, drop or move;
* the distractor after: the same scene, nothing changed.

Both after views are seen from a moved camera under changed lighting (see ``render.py``), so a
model must tell a real change from viewpoint and illumination distractors.

An object is one of 8 colors x 2 materials x 3 shapes x 2 sizes (the CLEVR attributes). No
two objects of a scene share all four attributes, so a full description always names exactly
one object. Captions use only words of the official CLEVR-Change vocabulary.

Everything here is a pure function of a ``numpy.random.Generator``: the builder seeds one per
example from (dataset seed, example id), so an example does not depend on the others.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {  # the CLEVR palette
    "gray": (87, 87, 87),
    "red": (173, 35, 35),
    "blue": (42, 75, 215),
    "green": (29, 105, 20),
    "brown": (129, 74, 25),
    "purple": (129, 38, 192),
    "cyan": (41, 208, 208),
    "yellow": (255, 238, 51),
}
MATERIALS = ("rubber", "metal")
SHAPES = ("cube", "sphere", "cylinder")
SIZES = ("small", "large")
CHANGE_TYPES = ("color", "material", "add", "drop", "move")  # label ids 0..4, as RCC
NO_CHANGE_LABEL = 5

# World units: objects live on the ground square [-ARENA, ARENA]^2; RADIUS is the footprint.
ARENA = 3.0
RADIUS = {"small": 0.38, "large": 0.7}

# Words a caption may use for each attribute value (all in the official 76-word vocabulary).
SIZE_WORDS = {"small": ("small", "tiny"), "large": ("large", "big")}
MATERIAL_WORDS = {"rubber": ("rubber", "matte"), "metal": ("metal", "metallic", "shiny")}
SHAPE_WORDS = {"cube": ("cube", "block"), "sphere": ("sphere", "ball"), "cylinder": ("cylinder",)}
GENERIC_WORDS = ("thing", "object")

TEMPLATES = {
    "color": ("{d} changed to {v}", "{d} turned {v}", "{d} became {v}"),
    "material": ("{d} changed to {v}", "{d} turned {v}", "{d} became {v}"),
    "add": ("{d} has been newly placed", "{d} has been added", "{d} has appeared"),
    "drop": ("{d} has disappeared", "{d} is missing", "{d} is gone", "{d} is no longer there"),
    "move": ("{d} changed its location", "{d} moved", "{d} is in a different location"),
}
NO_CHANGE_CAPTIONS = (
    "no change was made",
    "there is no change",
    "the two scenes seem identical",
    "the scene is the same as before",
    "the scene remains the same",
    "nothing has changed",
    "nothing was modified",
    "no change has occurred",
    "there is no difference",
)

# Which attributes a referring expression mentions; a subset is used only when it is unique.
_MENTION_SETS = (
    ("size", "color", "material", "shape"),
    ("size", "color", "shape"),
    ("color", "material", "shape"),
    ("size", "color", "material"),
    ("color", "shape"),
    ("size", "material", "shape"),
)


@dataclasses.dataclass(frozen=True)
class SceneObject:
    size: str
    color: str
    material: str
    shape: str
    x: float  # ground-plane position, world units
    y: float  # depth axis: larger is further from the camera
    yaw: float  # orientation in degrees (visible for cubes)

    @property
    def attributes(self) -> tuple[str, str, str, str]:
        return (self.size, self.color, self.material, self.shape)


@dataclasses.dataclass(frozen=True)
class Camera:
    """A camera change, applied to the ground plane: yaw (deg), translation, zoom."""

    yaw: float = 0.0
    tx: float = 0.0
    ty: float = 0.0
    zoom: float = 1.0


@dataclasses.dataclass(frozen=True)
class Lighting:
    """An illumination: light direction (azimuth deg), brightness, per-channel tint, ambient."""

    azimuth: float = 35.0
    brightness: float = 1.0
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0)
    ambient: float = 0.45


@dataclasses.dataclass(frozen=True)
class DistractorStrength:
    """Ranges of the camera and light changes of the after views."""

    max_yaw: float
    max_shift: float
    zoom_range: tuple[float, float]
    max_azimuth: float
    brightness_range: tuple[float, float]
    max_tint: float
    ambient_range: tuple[float, float]


DISTRACTORS = {
    # Like CLEVR-Change: small camera jitter and light changes.
    "moderate": DistractorStrength(
        max_yaw=8.0, max_shift=0.35, zoom_range=(0.92, 1.08), max_azimuth=25.0,
        brightness_range=(0.85, 1.15), max_tint=0.05, ambient_range=(0.4, 0.5),
    ),
    # Half of moderate's ranges: the default benchmark's distractors (docs/ablations.md,
    # "Why colour and material changes are missed").
    "weak": DistractorStrength(
        max_yaw=4.0, max_shift=0.175, zoom_range=(0.96, 1.04), max_azimuth=12.5,
        brightness_range=(0.925, 1.075), max_tint=0.025, ambient_range=(0.425, 0.475),
    ),
    # Like CLEVR-DC: large viewpoint moves and strong light changes.
    "extreme": DistractorStrength(
        max_yaw=30.0, max_shift=0.9, zoom_range=(0.78, 1.22), max_azimuth=90.0,
        brightness_range=(0.6, 1.4), max_tint=0.15, ambient_range=(0.3, 0.6),
    ),
    # Diagnostic only: the after views keep the before camera and light, so the sole
    # difference is the semantic change (separates "cannot see changes" from "cannot
    # discount distractors" when a model fails to learn).
    "none": DistractorStrength(
        max_yaw=0.0, max_shift=0.0, zoom_range=(1.0, 1.0), max_azimuth=0.0,
        brightness_range=(1.0, 1.0), max_tint=0.0, ambient_range=(0.45, 0.45),
    ),
}


@dataclasses.dataclass(frozen=True)
class Example:
    """One before scene with its two after views and their captions."""

    before: tuple[SceneObject, ...]
    after: tuple[SceneObject, ...]  # the semantic after scene
    change_type: str
    changed_index_before: int  # index of the changed object in `before` (-1 for add)
    changed_index_after: int  # index of the changed object in `after` (-1 for drop)
    camera_before: Camera
    camera_semantic: Camera
    camera_distractor: Camera
    light_before: Lighting
    light_semantic: Lighting
    light_distractor: Lighting
    change_captions: tuple[str, ...]
    no_change_captions: tuple[str, ...]


def _random_object(rng: np.random.Generator, placed: list[SceneObject]) -> SceneObject | None:
    """A new object with unique attributes at a free spot, or None after too many tries."""
    taken = {o.attributes for o in placed}
    for _ in range(200):
        attrs = (
            SIZES[rng.integers(len(SIZES))],
            list(COLORS)[rng.integers(len(COLORS))],
            MATERIALS[rng.integers(len(MATERIALS))],
            SHAPES[rng.integers(len(SHAPES))],
        )
        if attrs in taken:
            continue
        pos = _free_position(rng, attrs[0], placed)
        if pos is None:
            continue
        return SceneObject(*attrs, x=pos[0], y=pos[1], yaw=float(rng.uniform(0, 90)))
    return None


def _free_position(
    rng: np.random.Generator, size: str, placed: list[SceneObject],
    avoid: tuple[float, float] | None = None,
) -> tuple[float, float] | None:
    r = RADIUS[size]
    for _ in range(100):
        x, y = (float(v) for v in rng.uniform(-ARENA + r, ARENA - r, size=2))
        if all(math.hypot(x - o.x, y - o.y) > r + RADIUS[o.size] + 0.15 for o in placed):
            if avoid is None or math.hypot(x - avoid[0], y - avoid[1]) > 1.5:
                return x, y
    return None


def sample_scene(rng: np.random.Generator, min_objects: int, max_objects: int) -> list[SceneObject]:
    n = int(rng.integers(min_objects, max_objects + 1))
    while True:
        objects: list[SceneObject] = []
        for _ in range(n):
            obj = _random_object(rng, objects)
            if obj is None:
                break
            objects.append(obj)
        if len(objects) == n:
            return objects


def apply_change(
    rng: np.random.Generator, before: list[SceneObject], change_type: str
) -> tuple[list[SceneObject], int, int] | None:
    """The semantic after scene and the changed object's index before/after (None: retry)."""
    after = list(before)
    i = int(rng.integers(len(before)))
    obj = before[i]
    others = before[:i] + before[i + 1 :]
    taken = {o.attributes for o in others}
    if change_type == "color":
        choices = [c for c in COLORS if c != obj.color and (obj.size, c, obj.material, obj.shape)
                   not in taken]
        if not choices:
            return None
        after[i] = dataclasses.replace(obj, color=choices[rng.integers(len(choices))])
        return after, i, i
    if change_type == "material":
        new = "metal" if obj.material == "rubber" else "rubber"
        if (obj.size, obj.color, new, obj.shape) in taken:
            return None
        after[i] = dataclasses.replace(obj, material=new)
        return after, i, i
    if change_type == "move":
        pos = _free_position(rng, obj.size, others, avoid=(obj.x, obj.y))
        if pos is None:
            return None
        after[i] = dataclasses.replace(obj, x=pos[0], y=pos[1])
        return after, i, i
    if change_type == "drop":
        del after[i]
        return after, i, -1
    if change_type == "add":
        new_obj = _random_object(rng, before)
        if new_obj is None:
            return None
        return [*before, new_obj], -1, len(before)
    raise ValueError(f"unknown change type {change_type!r}; expected one of {CHANGE_TYPES}")


def same_objects(ex: Example) -> list[tuple[int, int]]:
    """(index in ``before``, index in ``after``) of every object the semantic change left
    untouched: the viewpoint IoU compares their boxes
    (``changecap_jax/evaluators/difficulty.py``)."""
    changed = ex.changed_index_before
    if ex.change_type == "add":
        return [(i, i) for i in range(len(ex.before))]
    if ex.change_type == "drop":
        return [(i, i if i < changed else i - 1) for i in range(len(ex.before)) if i != changed]
    return [(i, i) for i in range(len(ex.before)) if i != changed]


def _describe(rng: np.random.Generator, obj: SceneObject, mentions: tuple[str, ...]) -> str:
    words = []
    if "size" in mentions:
        words.append(_pick(rng, SIZE_WORDS[obj.size]))
    if "color" in mentions:
        words.append(obj.color)
    if "material" in mentions:
        words.append(_pick(rng, MATERIAL_WORDS[obj.material]))
    words.append(
        _pick(rng, SHAPE_WORDS[obj.shape]) if "shape" in mentions else _pick(rng, GENERIC_WORDS)
    )
    return "the " + " ".join(words)


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def unique_mention_sets(obj: SceneObject, scene: list[SceneObject]) -> list[tuple[str, ...]]:
    """The attribute subsets that pick out ``obj`` alone among ``scene``."""
    keys = ("size", "color", "material", "shape")
    out = []
    for mentions in _MENTION_SETS:
        sig = tuple(getattr(obj, k) for k in keys if k in mentions)
        matches = [o for o in scene if tuple(getattr(o, k) for k in keys if k in mentions) == sig]
        if len(matches) == 1:
            out.append(mentions)
    return out


def change_captions(
    rng: np.random.Generator, example_scene: list[SceneObject], obj: SceneObject,
    change_type: str, new_value: str | None, count: int,
) -> list[str]:
    """``count`` distinct paraphrases naming the changed object by its attributes."""
    mention_sets = unique_mention_sets(obj, example_scene)
    captions: list[str] = []
    for _ in range(50 * count):
        template = _pick(rng, TEMPLATES[change_type])
        d = _describe(rng, obj, mention_sets[int(rng.integers(len(mention_sets)))])
        v = new_value
        if change_type == "material":
            v = _pick(rng, MATERIAL_WORDS[new_value])
        caption = template.format(d=d, v=v)
        if caption not in captions:
            captions.append(caption)
            if len(captions) == count:
                break
    return captions


def _camera_change(rng: np.random.Generator, s: DistractorStrength) -> Camera:
    return Camera(
        yaw=float(rng.uniform(-s.max_yaw, s.max_yaw)),
        tx=float(rng.uniform(-s.max_shift, s.max_shift)),
        ty=float(rng.uniform(-s.max_shift, s.max_shift)),
        zoom=float(rng.uniform(*s.zoom_range)),
    )


def _light_change(rng: np.random.Generator, s: DistractorStrength, base: Lighting) -> Lighting:
    return Lighting(
        azimuth=base.azimuth + float(rng.uniform(-s.max_azimuth, s.max_azimuth)),
        brightness=float(rng.uniform(*s.brightness_range)),
        tint=tuple(float(t) for t in 1.0 + rng.uniform(-s.max_tint, s.max_tint, size=3)),
        ambient=float(rng.uniform(*s.ambient_range)),
    )


def sample_example(
    rng: np.random.Generator, change_type: str, distractors: str, captions_per_pair: int,
) -> Example:
    """One example: before scene, semantic change, two after views and their captions."""
    strength = DISTRACTORS[distractors]
    lo, hi = 3, 7
    if change_type == "add":
        hi = 6  # the after scene keeps to 3..7 objects
    if change_type == "drop":
        lo = 4
    while True:
        before = sample_scene(rng, lo, hi)
        changed = apply_change(rng, before, change_type)
        if changed is not None:
            break
    after, ib, ia = changed
    if change_type == "add":
        obj, scene, value = after[ia], after, None
    else:
        obj, scene = before[ib], before
        value = after[ia].color if change_type == "color" else (
            after[ia].material if change_type == "material" else None)
    captions = change_captions(rng, scene, obj, change_type, value, captions_per_pair)
    order = rng.permutation(len(NO_CHANGE_CAPTIONS))[:captions_per_pair]
    no_change = tuple(NO_CHANGE_CAPTIONS[k] for k in order)
    base_light = Lighting(azimuth=float(rng.uniform(20, 50)))
    return Example(
        before=tuple(before), after=tuple(after), change_type=change_type,
        changed_index_before=ib, changed_index_after=ia,
        camera_before=Camera(),
        camera_semantic=_camera_change(rng, strength),
        camera_distractor=_camera_change(rng, strength),
        light_before=base_light,
        light_semantic=_light_change(rng, strength, base_light),
        light_distractor=_light_change(rng, strength, base_light),
        change_captions=tuple(captions), no_change_captions=no_change,
    )
