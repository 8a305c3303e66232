"""Renders synthetic scenes to RGB images with a pinhole camera, using PIL only.

The camera looks horizontally across the ground square from height ``CAM_HEIGHT``; a world
point (x, y, z) at depth d = y + ``DEPTH_OFFSET`` lands at column W/2 + f*x/d and row
``HORIZON`` + f*(``CAM_HEIGHT`` - z)/d. A :class:`~.scenes.Camera` change rotates and shifts the
ground plane before projection and scales f (zoom), so objects change size, place and overlap
between views as in CLEVR-Change. Objects are drawn far to near (painter's algorithm), each
over a soft shadow cast away from the light.

Materials differ visibly: rubber is matte (soft, low-contrast shading); metal has strong
contrast and a white specular highlight. A :class:`~.scenes.Lighting` sets the light azimuth
(shading and shadow direction), the ambient level, the overall brightness and a colour tint.

Images are drawn at 2x and box-downsampled for anti-aliasing.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from changecap_jax.data.synthetic.scenes import COLORS, RADIUS, Camera, Lighting, SceneObject

SUPERSAMPLE = 2
DEPTH_OFFSET = 8.0
CAM_HEIGHT = 8.0
_FOCAL = 100.0 / 128.0  # focal length as a fraction of the image width
_HORIZON = -40.0 / 128.0  # horizon row as a fraction of the image height
_LIGHT_ELEVATION = math.radians(45.0)
_FLOOR = np.array([150.0, 150.0, 146.0])


def _to_camera(obj_x: float, obj_y: float, cam: Camera) -> tuple[float, float]:
    """Ground-plane point in the frame of a moved camera."""
    a = math.radians(cam.yaw)
    x = math.cos(a) * obj_x - math.sin(a) * obj_y + cam.tx
    y = math.sin(a) * obj_x + math.cos(a) * obj_y + cam.ty
    return x, y


class _Projector:
    def __init__(self, height: int, width: int, cam: Camera):
        self.w, self.h = width * SUPERSAMPLE, height * SUPERSAMPLE
        self.f = _FOCAL * self.w * cam.zoom
        self.horizon = _HORIZON * self.h

    def __call__(self, x: float, y: float, z: float) -> tuple[float, float]:
        d = max(y + DEPTH_OFFSET, 0.5)
        return self.w / 2 + self.f * x / d, self.horizon + self.f * (CAM_HEIGHT - z) / d

    def scale(self, y: float) -> float:
        """Pixels per world unit at depth y."""
        return self.f / max(y + DEPTH_OFFSET, 0.5)


def _light_vector(light: Lighting) -> np.ndarray:
    a = math.radians(light.azimuth)
    c = math.cos(_LIGHT_ELEVATION)
    return np.array([c * math.cos(a), c * math.sin(a), math.sin(_LIGHT_ELEVATION)])


def _shade(color: str, material: str, diffuse: float, light: Lighting) -> tuple[int, int, int]:
    base = np.array(COLORS[color], np.float64)
    diffuse = max(diffuse, 0.0)
    if material == "metal":  # high contrast, darker in shadow
        k = 0.25 + 1.05 * diffuse**1.5
    else:  # matte: flat, soft shading
        k = light.ambient + (1.0 - light.ambient) * 0.8 * diffuse
    return tuple(int(v) for v in np.clip(base * k, 0, 255))


def _bbox(points: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return min(xs), min(ys), max(xs), max(ys)


def _draw_object(
    draw: ImageDraw.ImageDraw, obj: SceneObject, cx: float, cy: float, proj: _Projector,
    cam: Camera, light: Lighting, lvec: np.ndarray,
) -> tuple[float, float, float, float]:
    """Draws one object at camera-frame ground position (cx, cy); returns its box (x0,y0,x1,y1)."""
    if obj.shape not in _DRAWERS:
        raise ValueError(f"unknown shape {obj.shape!r}")
    return _DRAWERS[obj.shape](draw, obj, cx, cy, proj, cam, light, lvec)


def _draw_cube(
    draw: ImageDraw.ImageDraw, obj: SceneObject, cx: float, cy: float, proj: _Projector,
    cam: Camera, light: Lighting, lvec: np.ndarray,
) -> tuple[float, float, float, float]:
    """A cube turned by its yaw: the visible sides, back to front, then the top."""
    r = RADIUS[obj.size]
    h = r * 0.78
    yaw = math.radians(obj.yaw - cam.yaw)
    corners = []
    for sx, sy in ((-1, -1), (1, -1), (1, 1), (-1, 1)):
        dx = h * (sx * math.cos(yaw) - sy * math.sin(yaw))
        dy = h * (sx * math.sin(yaw) + sy * math.cos(yaw))
        corners.append((cx + dx, cy + dy))
    base = [proj(x, y, 0.0) for x, y in corners]
    top = [proj(x, y, 2 * h) for x, y in corners]
    faces = []
    for k in range(4):
        (x0, y0), (x1, y1) = corners[k], corners[(k + 1) % 4]
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        nx, ny = mx - cx, my - cy
        # A side is visible when its outward normal points towards the camera at (0, -D).
        if nx * (0.0 - mx) + ny * (-DEPTH_OFFSET - my) > 0:
            n = np.array([nx, ny, 0.0]) / math.hypot(nx, ny)
            poly = [base[k], base[(k + 1) % 4], top[(k + 1) % 4], top[k]]
            faces.append((my, poly, float(n @ lvec)))
    for _, poly, diff in sorted(faces, key=lambda f: -f[0]):
        draw.polygon(poly, fill=_shade(obj.color, obj.material, diff, light))
    draw.polygon(top, fill=_shade(obj.color, obj.material, float(lvec[2]) + 0.1, light))
    if obj.material == "metal":
        tx = sum(p[0] for p in top) / 4
        ty = sum(p[1] for p in top) / 4
        s = proj.scale(cy) * h * 0.35
        draw.ellipse([tx - s, ty - s * 0.5, tx + s, ty + s * 0.5], fill=(250, 250, 250))
    return _bbox(base + top)


def _draw_sphere(
    draw: ImageDraw.ImageDraw, obj: SceneObject, cx: float, cy: float, proj: _Projector,
    cam: Camera, light: Lighting, lvec: np.ndarray,
) -> tuple[float, float, float, float]:
    """A sphere: a disc with a lit cap towards the light."""
    r = RADIUS[obj.size]
    u, v = proj(cx, cy, r)
    rho = proj.scale(cy) * r
    draw.ellipse([u - rho, v - rho, u + rho, v + rho],
                 fill=_shade(obj.color, obj.material, 0.15, light))
    # A lit cap offset towards the light: concentric discs give a cheap gradient.
    ox, oy = lvec[0] * rho * 0.35, -lvec[2] * rho * 0.3
    for frac, diff in ((0.8, 0.5), (0.55, 0.8)):
        rr = rho * frac
        draw.ellipse([u + ox - rr, v + oy - rr, u + ox + rr, v + oy + rr],
                     fill=_shade(obj.color, obj.material, diff, light))
    if obj.material == "metal":
        rr = rho * 0.22
        hx, hy = u + ox * 1.3, v + oy * 1.3
        draw.ellipse([hx - rr, hy - rr, hx + rr, hy + rr], fill=(252, 252, 252))
    return u - rho, v - rho, u + rho, v + rho


def _draw_cylinder(
    draw: ImageDraw.ImageDraw, obj: SceneObject, cx: float, cy: float, proj: _Projector,
    cam: Camera, light: Lighting, lvec: np.ndarray,
) -> tuple[float, float, float, float]:
    """An upright cylinder: base rim, side, lit stripe and top rim."""
    r = RADIUS[obj.size]
    height = 1.5 * r
    u0, v0 = proj(cx, cy, 0.0)
    u1, v1 = proj(cx, cy, height)
    rho = proj.scale(cy) * r
    # Vertical half-axis of the rim ellipses: projected depth extent of the rim.
    rv0 = abs(proj(cx, cy - r, 0.0)[1] - proj(cx, cy + r, 0.0)[1]) / 2
    rv1 = abs(proj(cx, cy - r, height)[1] - proj(cx, cy + r, height)[1]) / 2
    side = _shade(obj.color, obj.material, 0.3, light)
    draw.ellipse([u0 - rho, v0 - rv0, u0 + rho, v0 + rv0], fill=side)
    draw.rectangle([u1 - rho, v1, u0 + rho, v0], fill=side)
    lit_w = rho * 0.5
    lx = u1 + lvec[0] * rho * 0.4
    draw.rectangle([lx - lit_w, v1, lx + lit_w, v0],
                   fill=_shade(obj.color, obj.material, 0.75, light))
    draw.ellipse([u1 - rho, v1 - rv1, u1 + rho, v1 + rv1],
                 fill=_shade(obj.color, obj.material, float(lvec[2]) + 0.1, light))
    if obj.material == "metal":
        top_y = v1 + rv1
        draw.rectangle([lx - lit_w * 0.3, top_y, lx + lit_w * 0.3, max(top_y, v0 - rv0 * 0.5)],
                       fill=(248, 248, 248))
    return u0 - rho, v1 - rv1, u0 + rho, v0 + rv0


_DRAWERS = {"cube": _draw_cube, "sphere": _draw_sphere, "cylinder": _draw_cylinder}


def render(
    objects: tuple[SceneObject, ...] | list[SceneObject], cam: Camera, light: Lighting,
    image_size: tuple[int, int],
) -> tuple[np.ndarray, list[tuple[float, float, float, float]]]:
    """Renders a scene.

    Returns:
      (uint8 image (H, W, 3), per-object boxes [x, y, w, h] in output pixels, clipped to the
      image; a fully hidden or out-of-view object gets (0, 0, 0, 0)).
    """
    height, width = image_size
    proj = _Projector(height, width, cam)
    lvec = _light_vector(light)
    rows = np.linspace(0.75, 1.0, proj.h)[:, None, None]
    floor = np.broadcast_to(_FLOOR * rows, (proj.h, proj.w, 3)).astype(np.uint8)
    img = Image.fromarray(floor, "RGB")
    draw = ImageDraw.Draw(img, "RGBA")
    placed = [(_to_camera(o.x, o.y, cam), i, o) for i, o in enumerate(objects)]
    for (cx, cy), _, obj in placed:  # shadows first: they lie on the floor
        r = RADIUS[obj.size]
        sx = cx - lvec[0] * r * 0.9
        sy = cy - lvec[1] * r * 0.9
        u, v = proj(sx, sy, 0.0)
        rx, ry = proj.scale(sy) * r * 1.1, proj.scale(sy) * r * 0.45
        draw.ellipse([u - rx, v - ry, u + rx, v + ry], fill=(0, 0, 0, 70))
    boxes: list[tuple[float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0)] * len(objects)
    for (cx, cy), i, obj in sorted(placed, key=lambda p: -p[0][1]):
        x0, y0, x1, y1 = _draw_object(draw, obj, cx, cy, proj, cam, light, lvec)
        x0, x1 = (min(max(v / SUPERSAMPLE, 0.0), width) for v in (x0, x1))
        y0, y1 = (min(max(v / SUPERSAMPLE, 0.0), height) for v in (y0, y1))
        boxes[i] = (x0, y0, x1 - x0, y1 - y0)
    img = img.reduce(SUPERSAMPLE)
    lit = np.asarray(img, np.float32) * (light.brightness * np.asarray(light.tint, np.float32))
    return np.clip(lit + 0.5, 0, 255).astype(np.uint8), boxes
