"""Models named by a string (``timm:vit_base_patch16_224``, ``torchvision:resnet50``, ``hf:ViTModel``,
``package.module:factory``), built on the meta device by default so that planning allocates nothing.

Used by the CLI and the benchmarks; the python API takes any ``nn.Module`` directly.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .errors import ConfigError, positive_int

__all__ = ["load_model", "default_input", "PREFIXES"]

PREFIXES = ("timm", "torchvision", "hf")
_EXTRA = {"timm": "timm", "torchvision": "torchvision", "hf": "transformers"}
_DEFAULT_IMAGE = 224


def _import(prefix: str) -> Any:
    module = _EXTRA[prefix]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"model spec '{prefix}:...' needs the {module} package: pip install 'autopipe[{module}]'"
        ) from exc


def _unknown(kind: str, name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return ConfigError(f"unknown {kind} model {name!r}{hint}")


def _split(spec: str) -> tuple[str, str]:
    prefix, sep, name = spec.partition(":")
    if not sep or not prefix or not name:
        raise ConfigError(
            f"model spec {spec!r} is not PREFIX:NAME; use timm:NAME, torchvision:NAME, hf:CLASS "
            "or package.module:factory (e.g. timm:vit_base_patch16_224)"
        )
    return prefix, name


def _build_timm(name: str, kwargs: dict[str, Any]) -> nn.Module:
    timm = _import("timm")
    if not timm.is_model(name):
        raise _unknown("timm", name, timm.list_models())
    return timm.create_model(name, pretrained=False, **kwargs)


def _build_torchvision(name: str, kwargs: dict[str, Any]) -> nn.Module:
    _import("torchvision")
    from torchvision import models

    known = models.list_models()
    if name not in known:
        raise _unknown("torchvision", name, known)
    model = models.get_model(name, weights=None, **kwargs)
    # The smallest size its published weights were evaluated at: Inception v3's auxiliary head
    # needs 299 in train(); others take any size (224 then), or record their own (ViT).
    sizes = [w.transforms().crop_size for w in models.get_model_weights(name)]
    if sizes:
        model._autopipe_image_size = min(size[0] for size in sizes)
    return model


def _build_hf(name: str, kwargs: dict[str, Any]) -> nn.Module:
    transformers = _import("hf")
    cls = getattr(transformers, name, None)
    config_class = getattr(cls, "config_class", None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module) or config_class is None:
        known = [n for n in dir(transformers) if n[:1].isupper() and ("Model" in n or "For" in n)]
        raise _unknown("transformers", name, known)
    # kwargs override the default config (image_size=32, num_hidden_layers=2...): random init.
    return cls(config_class(**kwargs))


def _build_factory(spec: str, module_name: str, attr: str, kwargs: dict[str, Any]) -> nn.Module:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        close = difflib.get_close_matches(module_name, PREFIXES, n=1)
        hint = f"; did you mean '{close[0]}:{attr}'?" if close else ""
        raise ConfigError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({exc}); the prefix must be "
            f"one of {', '.join(PREFIXES)} or an importable package.module{hint}"
        ) from exc
    if not hasattr(module, attr):
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=5)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ConfigError(f"model spec {spec!r}: module {module_name!r} has no factory {attr!r}{hint}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise ConfigError(f"model spec {spec!r}: {module_name}.{attr} is a {type(factory).__name__}, not callable")
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"model spec {spec!r}: calling {module_name}.{attr}(**{kwargs}) failed: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model spec {spec!r}: {attr}() returned a {type(model).__name__}, not an nn.Module")
    return model


_BUILDERS: dict[str, Callable[[str, dict[str, Any]], nn.Module]] = {
    "timm": _build_timm,
    "torchvision": _build_torchvision,
    "hf": _build_hf,
}


def _rejects(error: TypeError, key: str) -> bool:
    return "unexpected keyword argument" in str(error) and f"'{key}'" in str(error)


def load_model(spec: str, *, meta: bool = True, image_size: int | None = None, **kwargs: Any) -> nn.Module:
    """Build the model ``spec`` names, randomly initialised, on the meta device unless ``meta=False``.

    ``image_size`` is passed as the model's own keyword (timm ``img_size``, torchvision
    ``image_size``, transformers config ``image_size``) where it takes one, and ignored elsewhere
    (a ResNet takes any size). Other ``kwargs`` go to the constructor (the config for ``hf:``).
    """
    prefix, name = _split(spec)
    build: Callable[[dict[str, Any]], nn.Module]
    if prefix in _BUILDERS:
        build = lambda kw: _BUILDERS[prefix](name, kw)  # noqa: E731
    else:
        build = lambda kw: _build_factory(spec, prefix, name, kw)  # noqa: E731
    size_key = {"timm": "img_size", "torchvision": "image_size", "hf": "image_size"}.get(prefix)

    def sized() -> nn.Module:
        if image_size is None or size_key is None:
            return build(kwargs)
        try:
            return build({size_key: image_size, **kwargs})
        except TypeError as exc:
            # The architecture has no such keyword: its input size is free.
            if not _rejects(exc, size_key):
                raise
            return build(kwargs)

    try:
        if not meta:
            return sized()
        try:
            with torch.device("meta"):
                return sized()
        except (NotImplementedError, RuntimeError) as exc:
            if not _needs_data(exc):
                raise
        # See [Note: constructors that compute]: only the parameters go to meta.
        with _parameters_on_meta():
            model = sized()
        return model.to("meta")
    except ImportError as exc:  # transformers' Dinat needs natten, and says so
        raise ConfigError(f"model spec {spec!r} needs a package that is not installed: "
                          f"{' '.join(str(exc).split())}") from exc


# [Note: constructors that compute]
# Some constructors compute with tensors: torchvision's RegNets derive their stage widths with
# torch.arange(...).tolist(), and a meta tensor holds no data to read back ("Cannot copy out of
# meta tensor"). Such a model is built again with the default device left alone and each
# parameter moved to meta as it is registered, before its initialisation runs: the arithmetic
# runs on CPU, and no more than one parameter is ever allocated at a time. Buffers (small, and
# sometimes computed: masks, position tables) are built on CPU and moved to meta at the end.
def _needs_data(exc: BaseException) -> bool:
    # "Cannot copy out of meta tensor; no data!", "Tensor.item() cannot be called on meta tensors",
    # and an op with no meta kernel (timm's RegNets run torch.unique; on torch 2.11: "attempted to
    # run this operator with Meta tensors, but there was no fake impl or Meta kernel registered")
    message = str(exc).lower()
    return "meta tensor" in message or "meta kernel" in message


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _image_shape(model: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) the model expects, from what each library records."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "image_size"):  # transformers
        size = config.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return int(getattr(config, "num_channels", 3)), int(h), int(w)
    channels = 3
    for attr in ("pretrained_cfg", "default_cfg"):  # timm
        cfg = getattr(model, attr, None)
        if isinstance(cfg, dict) and "input_size" in cfg:
            channels, h, w = cfg["input_size"]
            break
    else:
        h = w = getattr(model, "_autopipe_image_size", _DEFAULT_IMAGE)  # torchvision's, from its weights
    # A model built with another size records it on itself (timm patch_embed, torchvision ViT).
    patch_embed = getattr(model, "patch_embed", None)
    own = next((v for v in (getattr(patch_embed, "img_size", None), getattr(model, "image_size", None),
                            getattr(model, "img_size", None)) if v), None)
    if isinstance(own, int):
        h = w = own
    elif isinstance(own, (tuple, list)) and len(own) == 2:
        h, w = own
    return int(channels), int(h), int(w)


# transformers inputs that are not an image batch: NaFlex models (Siglip2) take patches with
# their mask and grid shapes.
_PATCH_INPUTS = ("pixel_attention_mask", "spatial_shapes")


def _check_image_input(model: nn.Module) -> None:
    """Refuse a model whose first input is not an image batch (ImageGPT's input_ids...)."""
    first = getattr(model, "main_input_name", "pixel_values")
    try:
        params = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = set()
    needs = [p for p in _PATCH_INPUTS if p in params]
    if first == "pixel_values" and not needs:
        return
    what = f"'{first}'" if first != "pixel_values" else "patches with " + " and ".join(needs)
    raise ConfigError(
        f"{type(model).__name__} takes {what}, not an image batch (batch, channels, height, width), "
        "which is all a default input can be; plan it from python with example inputs of its own: "
        "autopipe.planning.plan_model(model, pp=..., example_inputs=(...))"
    )


def default_input(
    model_or_spec: nn.Module | str, batch: int, *, image_size: int | None = None
) -> torch.Tensor:
    """A meta image batch ``(batch, C, H, W)`` of the size the model expects (224 when unknown).

    ``image_size`` overrides the guess; a spec string is loaded on meta first. A model that does
    not take an image batch (transformers' ImageGPT takes token ids) raises ConfigError.
    """
    positive_int("batch", batch)
    model = load_model(model_or_spec, image_size=image_size) if isinstance(model_or_spec, str) else model_or_spec
    _check_image_input(model)
    channels, h, w = _image_shape(model)
    if image_size is not None:
        h = w = image_size
    return torch.empty(batch, channels, h, w, device="meta")
