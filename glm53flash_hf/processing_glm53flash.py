"""Processor for GLM-5.3-Flash: text, images and videos in, model inputs out.

:class:`Glm53FlashProcessor` (``AutoProcessor`` through ``auto_map``): transformers' ``Glm5NextImageProcessorPil``,
a tokenizer with the GLM special tokens, :class:`Glm53FlashVideoProcessor` and ``chat_template.jinja``. Placeholder
expansion follows transformers 5.24's ``Glm5NextProcessor`` (``models/glm5_next/processing_glm5_next.py``):

* ``<|image|>`` -> ``<|image|>`` x (t*h*w / merge^2) for the image's ``image_grid_thw`` row.
* ``<|video|>`` -> per tubelet: ``<|begin_of_image|>`` + ``<|image|>`` x (h*w / merge^2) + ``<|end_of_image|>`` +
  ``"{t:.1f} seconds"``, ``t = frames_indices[::temporal_patch_size] / fps`` (24 fps, warned, without one).
* ``mm_token_type_ids``: 1 for ``<|image|>`` outside a video span, 2 inside one, 0 otherwise.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import warnings

import numpy as np
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ChannelDimension,
    PILImageResampling,
    SizeDict,
    infer_channel_dimension_format,
)
from transformers.models.glm5_next.image_processing_pil_glm5_next import smart_resize
from transformers.processing_utils import MultiModalData, ProcessorMixin, VideosKwargs
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata, is_valid_video, make_batched_metadata, make_batched_videos

CHAT_TEMPLATE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_template.jinja")

IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
BEGIN_OF_IMAGE = "<|begin_of_image|>"
END_OF_IMAGE = "<|end_of_image|>"
BEGIN_OF_VIDEO = "<|begin_of_video|>"
END_OF_VIDEO = "<|end_of_video|>"
END_OF_TEXT = "<|endoftext|>"

# Tokens the processor needs as single vocabulary entries (looked up by string in the tokenizer).
REQUIRED_TOKENS = (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    BEGIN_OF_IMAGE,
    END_OF_IMAGE,
    BEGIN_OF_VIDEO,
    END_OF_VIDEO,
    END_OF_TEXT,
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
)

# Files of which a saved tokenizer holds at least one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# Frames per second assumed for a video whose metadata has none (the reference's default).
DEFAULT_VIDEO_FPS = 24


def load_chat_template() -> str:
    """The GLM-5.3 chat template shipped with this package (``chat_template.jinja``), as a string;
    ``FileNotFoundError`` when the file is missing next to this module."""
    if not os.path.isfile(CHAT_TEMPLATE_FILE):
        raise FileNotFoundError(
            f"the GLM-5.3 chat template {CHAT_TEMPLATE_FILE} is missing; pass chat_template= explicitly or load "
            "the processor from a folder that holds chat_template.jinja"
        )
    with open(CHAT_TEMPLATE_FILE, encoding="utf-8") as f:
        return f.read()


def _positive_number(value) -> bool:
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _frame_shape(frame) -> tuple | None:
    """``(height, width, channels)`` of a PIL image or a 2-D / 3-D array, else ``None``."""
    if hasattr(frame, "getbands") and hasattr(frame, "size"):  # PIL.Image
        return (frame.size[1], frame.size[0], len(frame.getbands()))
    shape = getattr(frame, "shape", None)
    return tuple(shape) if shape is not None and len(shape) in (2, 3) else None


def _check_frame_sizes(videos) -> None:
    """Raise ``ValueError`` naming the video and both sizes when a video given as frames mixes frame sizes."""
    nested = isinstance(videos, (list, tuple)) and len(videos) > 0 and isinstance(videos[0], (list, tuple))
    for index, video in enumerate(videos if nested else [videos]):
        if not isinstance(video, (list, tuple)) or not video:
            continue
        shapes = [_frame_shape(frame) for frame in video]
        if any(shape is None for shape in shapes):
            continue
        for j, shape in enumerate(shapes):
            if shape != shapes[0]:
                raise ValueError(
                    f"video {index}: frame {j} has size {shape} but frame 0 has {shapes[0]} ((height, width, "
                    "channels)); the frames of a video must share one size (resize them first)"
                )


def _check_video_metadata(index: int, frames: int, meta, sampled: bool) -> None:
    """Raise ``ValueError`` naming the video, field and value when video ``index``'s metadata does not fit its clip."""
    name = f"video {index}"
    if sampled:
        total = meta.total_num_frames
        if total is not None and total != frames:
            raise ValueError(
                f"{name}: video_metadata.total_num_frames={total} but the clip holds {frames} frames; the metadata "
                "must describe the clip passed (frame sampling reads frames 0 .. total_num_frames - 1)"
            )
        return
    if meta.fps is not None and not _positive_number(meta.fps):
        raise ValueError(f"{name}: video_metadata.fps must be a finite number > 0; got fps={meta.fps!r}")
    if meta.frames_indices is None:
        return
    indices = [int(i) for i in np.asarray(meta.frames_indices).reshape(-1)]
    if len(indices) != frames:
        raise ValueError(
            f"{name}: video_metadata.frames_indices has {len(indices)} entries but the clip holds {frames} "
            "frames; give one source index per frame"
        )
    for j, (a, b) in enumerate(zip(indices, indices[1:])):
        if b < a:
            raise ValueError(
                f"{name}: video_metadata.frames_indices decrease at position {j + 1} ({a} then {b}); the frame "
                "timestamps (index / fps) must not go back in time"
            )
    if indices and indices[0] < 0:
        raise ValueError(f"{name}: video_metadata.frames_indices starts at {indices[0]}; indices must be >= 0")


# Arguments of transformers' file lookup that locate a folder's files (passed on to ``cached_file``).
_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision")


def _folder_file(path_or_repo, name: str, subfolder: str, kwargs: dict) -> str | None:
    """The local path of file ``name`` of a folder or Hub repo (``kwargs``: transformers' download arguments), or
    None when it has none."""
    from transformers.utils import cached_file

    location = {k: kwargs[k] for k in _DOWNLOAD_KWARGS if k in kwargs}
    return cached_file(
        path_or_repo, name, subfolder=subfolder, _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False, **location,
    )  # fmt: skip


def _read_folder_json(path_or_repo, name: str, subfolder: str, kwargs: dict) -> tuple[dict | None, str]:
    """``(parsed JSON object or None when absent, path shown in messages)`` of ``name`` in a folder or Hub repo;
    ``ValueError`` naming the file when it is not a JSON object."""
    resolved = _folder_file(path_or_repo, name, subfolder, kwargs)
    shown = os.path.join(os.fspath(path_or_repo), subfolder, name)  # subfolder "" adds no separator
    if resolved is None:
        return None, shown
    try:
        with open(resolved, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{shown}: not a readable JSON file ({type(e).__name__}: {e})") from e
    if not isinstance(content, dict):
        raise ValueError(f"{shown}: expected a JSON object; got {type(content).__name__}")
    return content, shown


def restore_missing_tokenizer_config(tokenizer, path_or_repo, subfolder: str = "", **kwargs) -> None:
    """Give ``tokenizer``, loaded from a folder (or Hub repo) without ``tokenizer_config.json``, the settings that
    file holds in every GLM-5.3 processor, with a warning naming what was restored: pad and EOS tokens from the
    folder's ``pad_token_id`` and first ``eos_token_id``, ``model_max_length`` from ``max_position_embeddings``
    (``config.json``'s ``text_config``, then its top level, then ``generation_config.json``), left padding, and the
    tokenizer's special added tokens as ``extra_special_tokens``. Without the file transformers leaves pad and EOS
    unset and pads on the right, which ``generate`` refuses. What ``kwargs`` sets (``pad_token=``, ``eos_token=``,
    ``padding_side=``, ``model_max_length=``, ``extra_special_tokens=``) is kept. Does nothing when the folder has
    ``tokenizer_config.json``.

    Raises:
        ValueError: neither file gives a ``pad_token_id`` / ``eos_token_id`` (names the folder and the files read),
            or an id is outside the tokenizer's ``[0, len(tokenizer))`` (names the file, field and value).
    """
    if _folder_file(path_or_repo, "tokenizer_config.json", subfolder, kwargs) is not None:
        return
    config, config_path = _read_folder_json(path_or_repo, "config.json", subfolder, kwargs)
    generation, generation_path = _read_folder_json(path_or_repo, "generation_config.json", subfolder, kwargs)
    folder = os.path.dirname(config_path)
    sources = [(c, p) for c, p in (((config or {}).get("text_config"), config_path), (config, config_path),
                                   (generation, generation_path)) if isinstance(c, dict)]  # fmt: skip

    def lookup(field):
        for content, path in sources:
            value = content.get(field)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return value, path
        return None, None

    restored = []
    for token_field, id_field in (("pad_token", "pad_token_id"), ("eos_token", "eos_token_id")):
        if kwargs.get(token_field) is not None:
            continue
        token_id, path = lookup(id_field)
        if token_id is None:
            raise ValueError(
                f"{folder} has no tokenizer_config.json, so the tokenizer has no {token_field} (transformers leaves "
                f"it None and pads on the right), and neither {config_path} nor {generation_path} gives an "
                f"{id_field} to restore it from. Save the tokenizer config into the folder "
                "(processor.save_pretrained(folder)), or pass "
                f"{token_field}=... to from_pretrained"
            )
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < len(tokenizer):
            raise ValueError(
                f"{path}: {id_field}={token_id!r} is not a token id of the tokenizer (expected an int in "
                f"[0, {len(tokenizer)})); it cannot restore the {token_field} missing with tokenizer_config.json"
            )
        token = tokenizer.convert_ids_to_tokens(token_id)
        setattr(tokenizer, token_field, token)
        restored.append(f"{token_field}={token!r} (id {token_id}, {id_field} of {os.path.basename(path)})")
    extra = [t.content for _, t in sorted(tokenizer.added_tokens_decoder.items())
             if t.special and t.content not in tokenizer.all_special_tokens]  # fmt: skip
    if extra and kwargs.get("extra_special_tokens") is None:
        # tokens of the vocabulary already: flagged special, nothing added
        tokenizer.add_special_tokens({"extra_special_tokens": extra}, replace_extra_special_tokens=False)
        restored.append(f"extra_special_tokens: the {len(extra)} other special tokens of the tokenizer")
    if kwargs.get("padding_side") is None:
        tokenizer.padding_side = "left"
        restored.append("padding_side='left' (generate takes left padding only)")
    max_length, path = lookup("max_position_embeddings")
    if kwargs.get("model_max_length") is None and isinstance(max_length, int) and max_length > 0:
        tokenizer.model_max_length = max_length
        restored.append(f"model_max_length={max_length} (max_position_embeddings of {os.path.basename(path)})")
    warnings.warn(
        f"{folder} has no tokenizer_config.json: transformers would leave the tokenizer without pad and EOS tokens, "
        f"padding on the right. Restored as every GLM-5.3 processor saves it: {', '.join(restored)}. Write the file "
        f"with processor.save_pretrained({folder!r}) to silence this warning.",
        UserWarning,
        stacklevel=2,
    )


class Glm53FlashVideoProcessorKwargs(VideosKwargs, total=False):
    """Keyword arguments of :class:`Glm53FlashVideoProcessor` on top of transformers' ``VideosKwargs`` (defaults: its
    class attributes; ``min_image_tokens`` / ``max_image_tokens``: the clip's token budget for ``smart_resize``)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    patch_expand_factor: int
    max_frames: int
    min_image_tokens: int
    max_image_tokens: int


class Glm53FlashVideoProcessor(VideoProcessorMixin, PilBackend):
    """The glm5_next video pipeline (transformers' ``Glm5NextVideoProcessor``) on the PIL/NumPy backend.

    Per video ``[T, H, W, C]`` or ``[T, C, H, W]`` (uint8 or float, RGB): frame sampling (:meth:`sample_frames`;
    ``do_sample_frames=False`` for pre-sampled frames), ``smart_resize`` over the clip with PIL bicubic resize and zero
    padding to the aligned canvas, rescale and CLIP normalisation, patchify (:meth:`patchify`).

    Output: ``pixel_values_videos`` float32 ``[sum(t*h*w), C*temporal*patch*patch]``, ``video_grid_thw`` int64
    ``[num_videos, 3]``, and ``video_metadata`` when ``return_metadata=True``.
    """

    resample = PILImageResampling.BICUBIC
    size = {"longest_edge": 1}
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    do_sample_frames = True
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    patch_expand_factor = 1
    max_duration = 0
    max_frames = 2048
    num_frames = 16
    fps = 2
    min_image_tokens = 16
    max_image_tokens = 240000
    valid_kwargs = Glm53FlashVideoProcessorKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def sample_frames(self, metadata: VideoMetadata, fps: int | float | None = None, **kwargs) -> np.ndarray:
        """Indices (int64, even length) of the frames to keep at ``fps`` (default ``self.fps``) frames per second, by
        the rule of ``Glm5NextVideoProcessor.sample_frames``. ``ValueError`` when the metadata has no ``fps``, for
        ``fps`` or the metadata's ``fps`` not a finite number > 0, or ``total_num_frames`` < 1."""
        if metadata is None or getattr(metadata, "fps", None) is None:
            raise ValueError(
                "Glm53FlashVideoProcessor samples frames by time and needs video_metadata with an fps; pass "
                "video_metadata=... or do_sample_frames=False for frames that are already sampled"
            )
        target_fps = fps if fps is not None else self.fps
        if not _positive_number(target_fps):
            raise ValueError(f"fps (frames sampled per second) must be a finite number > 0; got fps={target_fps!r}")
        if not _positive_number(metadata.fps):
            raise ValueError(f"video_metadata.fps must be a finite number > 0; got fps={metadata.fps!r}")
        if not isinstance(metadata.total_num_frames, (int, np.integer)) or metadata.total_num_frames < 1:
            raise ValueError(
                f"video_metadata.total_num_frames must be an integer >= 1; got {metadata.total_num_frames!r}"
            )
        total = int(metadata.total_num_frames)
        source_fps = float(metadata.fps)
        duration = metadata.duration or round((total - 1) / source_fps) + 1
        whole_seconds = int(duration)  # the greedy pick stops here, from the uncapped duration
        if self.max_duration > 0:
            duration = min(duration, self.max_duration)
        wanted = min(int(duration * target_fps), self.max_frames)

        if total < wanted:
            picked = np.linspace(0, total - 1, wanted, dtype=int).tolist()
        else:
            picked, next_time, step = [], 0.0, 1 / target_fps
            for index in range(total):
                if index / source_fps >= next_time:
                    picked.append(index)
                    next_time += step
                    if next_time >= whole_seconds:
                        break
        if len(picked) < wanted:
            first, last = (picked[0], picked[-1]) if picked else (0, total - 1)
            picked = np.linspace(first, last, wanted, dtype=int).tolist()
        elif len(picked) > wanted:
            picked = np.linspace(0, total - 1, wanted, dtype=int).tolist()

        unique = list(dict.fromkeys(picked))
        if len(unique) % 2:
            unique.append(unique[-1])
        return np.array(unique, dtype=int)

    def _decode_and_sample_videos(self, videos, video_metadata, do_sample_frames=None, sample_indices_fn=None):
        """Batch the videos and their metadata, decode paths/URLs, and sample frames when asked."""
        _check_frame_sizes(videos)
        videos = make_batched_videos(videos)
        if videos and not is_valid_video(videos[0]):
            if isinstance(videos[0], (str, os.PathLike)):
                return self.fetch_videos(videos, sample_indices_fn=sample_indices_fn)
            raise ValueError(
                f"videos must be arrays/tensors [T, H, W, C] or [T, C, H, W], lists of frames, or paths; got "
                f"{type(videos[0]).__name__}"
            )
        # Copies: sampling records frames_indices, and the caller's metadata objects stay as they were.
        metadata = [copy.copy(meta) for meta in make_batched_metadata(videos, video_metadata=video_metadata)]
        for i, (video, meta) in enumerate(zip(videos, metadata)):
            _check_video_metadata(i, len(video), meta, sampled=bool(do_sample_frames))
        if do_sample_frames:
            for meta in metadata:
                meta.frames_indices = sample_indices_fn(metadata=meta)
            videos = [video[meta.frames_indices] for video, meta in zip(videos, metadata)]
        return videos, metadata

    def _prepare_input_videos(self, videos, do_convert_rgb=None, input_data_format=None, device=None):
        """Each video as a channels-first NumPy array ``[T, C, H, W]`` with 3 (RGB) channels."""
        prepared = []
        for video in videos:
            if hasattr(video, "detach"):  # torch tensor
                video = video.detach().cpu().numpy()
            video = np.asarray(video)
            if video.ndim != 4:
                raise ValueError(f"a video must be 4-D [T, H, W, C] or [T, C, H, W]; got shape {video.shape}")
            layout = input_data_format or infer_channel_dimension_format(video[0], num_channels=(1, 3, 4))
            if layout == ChannelDimension.LAST:
                video = np.moveaxis(video, -1, 1)
            channels = video.shape[1]
            if channels == 1 and do_convert_rgb:
                video = np.repeat(video, 3, axis=1)
            elif channels != 3:
                raise ValueError(
                    f"video frames must be RGB (3 channels) or grayscale (1 channel with do_convert_rgb); got "
                    f"{channels} channels in a video of shape {video.shape}. Convert the frames to RGB first."
                )
            prepared.append(np.ascontiguousarray(video))
        return prepared

    def _canvas(self, num_frames: int, height: int, width: int, factor: int, temporal_factor: int,
                min_image_tokens: int, max_image_tokens: int) -> tuple[int, int, int, int]:
        """``(target_h, target_w, content_h, content_w)``: the aligned canvas and the resized content inside it."""
        target_h, target_w = smart_resize(
            num_frames=num_frames, height=height, width=width, temporal_factor=temporal_factor, factor=factor,
            min_pixels=min_image_tokens, max_pixels=max_image_tokens,
        )  # fmt: skip
        scale = min(target_h / height, target_w / width)
        if num_frames * height * width >= temporal_factor * factor**2 * min_image_tokens:
            scale = min(1.0, scale)  # only clips below the minimum budget are enlarged
        content_h = max(1, min(target_h, math.floor(height * scale)))
        content_w = max(1, min(target_w, math.floor(width * scale)))
        return target_h, target_w, content_h, content_w

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs=None) -> int:
        """Vision-tower patches (``t * h * w``, before the merge) of a sampled clip (``videos_kwargs`` override)."""
        kw = videos_kwargs or {}
        patch = kw.get("patch_size") or self.patch_size
        merge = kw.get("merge_size") or self.merge_size
        temporal = kw.get("temporal_patch_size") or self.temporal_patch_size
        expand = kw.get("patch_expand_factor") or self.patch_expand_factor
        target_h, target_w = smart_resize(
            num_frames, height, width, temporal, patch * merge * expand,
            kw.get("min_image_tokens") or self.min_image_tokens, kw.get("max_image_tokens") or self.max_image_tokens,
        )  # fmt: skip
        grid_t = -(-num_frames // temporal)
        return grid_t * (target_h // patch) * (target_w // patch)

    @staticmethod
    def patchify(video: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int):
        """Cut a ``[T, C, H, W]`` clip into ``(patches, grid_t, grid_h, grid_w)``: ``patches`` is
        ``[grid_t*grid_h*grid_w, C*temporal_patch_size*patch_size**2]``, rows ``(t, h/merge, w/merge, merge_h,
        merge_w)``, features ``(C, temporal, patch_h, patch_w)``; an incomplete last tubelet repeats the last frame.
        ``ValueError`` when H or W is not a multiple of ``patch_size * merge_size``."""
        frames, channels, height, width = video.shape
        unit = patch_size * merge_size
        if height % unit or width % unit:
            raise ValueError(f"frames of {height}x{width} are not multiples of patch*merge={unit}")
        if missing := -frames % temporal_patch_size:
            video = np.concatenate([video, np.repeat(video[-1:], missing, axis=0)], axis=0)
            frames += missing
        grid_t, grid_h, grid_w = frames // temporal_patch_size, height // patch_size, width // patch_size
        blocks = video.reshape(
            grid_t, temporal_patch_size, channels,
            grid_h // merge_size, merge_size, patch_size,
            grid_w // merge_size, merge_size, patch_size,
        )
        # -> (t, h/merge, w/merge, merge_h, merge_w, C, temporal, patch_h, patch_w)
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        patches = blocks.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size**2)
        return patches, grid_t, grid_h, grid_w

    def _preprocess(
        self,
        videos: list[np.ndarray],
        do_resize: bool = True,
        resample=PILImageResampling.BICUBIC,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean=None,
        image_std=None,
        patch_size: int | None = None,
        temporal_patch_size: int | None = None,
        merge_size: int | None = None,
        patch_expand_factor: int | None = None,
        min_image_tokens: int | None = None,
        max_image_tokens: int | None = None,
        return_tensors=None,
        **kwargs,
    ) -> BatchFeature:
        """Resize, pad, rescale, normalize and patchify each ``[T, C, H, W]`` clip."""
        all_patches, grids = [], []
        factor = patch_size * merge_size * patch_expand_factor
        for video in videos:
            frames, _, height, width = video.shape
            if do_resize:
                target_h, target_w, content_h, content_w = self._canvas(
                    frames, height, width, factor, temporal_patch_size, min_image_tokens, max_image_tokens
                )
                if (content_h, content_w) != (height, width):
                    size = SizeDict(height=content_h, width=content_w)
                    video = np.stack([self.resize(frame, size=size, resample=resample) for frame in video])
                video = np.pad(
                    video, ((0, 0), (0, 0), (0, target_h - content_h), (0, target_w - content_w)), mode="constant"
                )
            clip = []
            for frame in video:
                if do_rescale:
                    frame = self.rescale(frame, rescale_factor)
                if do_normalize:
                    frame = self.normalize(frame, image_mean, image_std)
                clip.append(np.asarray(frame, dtype=np.float32))
            patches, grid_t, grid_h, grid_w = self.patchify(np.stack(clip), patch_size, merge_size, temporal_patch_size)
            all_patches.append(patches)
            grids.append([grid_t, grid_h, grid_w])
        data = {
            "pixel_values_videos": np.concatenate(all_patches, axis=0),
            "video_grid_thw": np.array(grids, dtype=np.int64),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)


class Glm53FlashProcessor(ProcessorMixin):
    """GLM-5.3-Flash processor: tokenizer + glm5_next image processor + video processor + chat template.

    ``processor(text=..., images=..., videos=...)`` returns ``input_ids``, ``attention_mask``, ``mm_token_type_ids``
    and, when given media, ``pixel_values`` + ``image_grid_thw`` / ``pixel_values_videos`` + ``video_grid_thw``.

    ``image_processor`` needs a ``merge_size``; ``tokenizer``: a fast tokenizer holding every token of
    :data:`REQUIRED_TOKENS` as one vocabulary entry; ``chat_template`` defaults to the packaged one.

    Raises:
        ValueError: a missing processor or special token (names the tokens); marker/media count mismatches.
    """

    return_mm_token_type_ids = True
    text_kwargs = {"return_token_type_ids": False}
    videos_kwargs = {"return_metadata": True}

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        if tokenizer is None:
            raise ValueError("Glm53FlashProcessor needs a tokenizer")
        if image_processor is None or video_processor is None:
            raise ValueError(
                "Glm53FlashProcessor needs an image_processor (e.g. transformers.Glm5NextImageProcessorPil()) and a "
                "video_processor (e.g. Glm53FlashVideoProcessor())"
            )
        self.token_ids = self._lookup_token_ids(tokenizer)
        self.image_token = IMAGE_TOKEN
        self.video_token = VIDEO_TOKEN
        self.image_token_id = self.token_ids[IMAGE_TOKEN]
        self.video_token_id = self.token_ids[VIDEO_TOKEN]
        self.video_start_id = self.token_ids[BEGIN_OF_VIDEO]
        self.video_end_id = self.token_ids[END_OF_VIDEO]
        self._warned_missing_fps = False
        if chat_template is None and os.path.isfile(CHAT_TEMPLATE_FILE):
            chat_template = load_chat_template()
        super().__init__(image_processor, tokenizer, video_processor, chat_template=chat_template, **kwargs)

    def check_argument_for_proper_class(self, argument_name, argument):
        """transformers' class check (``TypeError`` for another class); the video processor is checked against
        ``VideoProcessorMixin`` directly."""
        if argument_name == "video_processor":
            if not isinstance(argument, VideoProcessorMixin):
                raise TypeError(
                    f"Received a {type(argument).__name__} for argument video_processor, but a VideoProcessorMixin "
                    "(e.g. Glm53FlashVideoProcessor) was expected."
                )
            return VideoProcessorMixin
        return super().check_argument_for_proper_class(argument_name, argument)

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        """transformers' input validation, after :func:`_check_frame_sizes`."""
        if videos is not None:
            _check_frame_sizes(videos)
        return super().validate_inputs(images=images, text=text, videos=videos, audio=audio, **kwargs)

    @staticmethod
    def _lookup_token_ids(tokenizer) -> dict[str, int]:
        """``{token: id}`` for :data:`REQUIRED_TOKENS`; ``ValueError`` naming the tokens missing from the vocabulary,
        or those that tokenizing the token's own text does not give back as its one id (not an added token)."""
        ids, missing = {}, []
        for token in REQUIRED_TOKENS:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
                missing.append(token)
            else:
                ids[token] = int(token_id)
        if missing:
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) lacks the GLM special tokens "
                f"{missing}; GLM-5.3-Flash needs each of {list(REQUIRED_TOKENS)} as a single token"
            )
        # In the vocabulary is not enough: the processor and the chat template write these tokens into the text, so
        # the tokenizer must read each of them back as its one id (an added token), not split it into pieces.
        encodings = {token: list(tokenizer.encode(token, add_special_tokens=False)) for token in ids}
        split = {token: encoded for token, encoded in encodings.items() if encoded != [ids[token]]}
        if split:
            token, encoded = next(iter(split.items()))
            also = f" (also split: {list(split)[1:]})" if len(split) > 1 else ""
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) holds {token!r} (id "
                f"{ids[token]}) in its vocabulary but does not read it as one token: tokenizing {token!r} gives ids "
                f"{encoded} ({tokenizer.convert_ids_to_tokens(encoded)}), expected [{ids[token]}]{also}. The "
                "processor writes these tokens into the text (image and video placeholders, chat turns), so each "
                "must be an added token of the tokenizer: "
                f"tokenizer.add_tokens({list(split)}, special_tokens=True)"
            )
        return ids

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """Expansion of the ``image_idx``-th ``<|image|>``: ``<|image|>`` x (prod(image_grid_thw) / merge^2)."""
        merge = kwargs.get("merge_size") or self.image_processor.merge_size
        count = int(np.prod(np.asarray(image_inputs["image_grid_thw"][image_idx]))) // merge**2
        return self.image_token * count

    def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
        """Expansion of the ``video_idx``-th ``<|video|>`` (module docstring); ``ValueError`` when the metadata has no
        ``frames_indices``, or they do not give one timestamp per tubelet."""
        merge = kwargs.get("merge_size") or self.video_processor.merge_size
        temporal = kwargs.get("temporal_patch_size") or self.video_processor.temporal_patch_size
        grid_t, grid_h, grid_w = (int(v) for v in np.asarray(video_inputs["video_grid_thw"][video_idx]))
        per_tubelet = grid_h * grid_w // merge**2
        metadata = video_inputs["video_metadata"][video_idx]
        fps = metadata.fps
        if fps is None:
            if not self._warned_missing_fps:
                warnings.warn(
                    f"video {video_idx} has no fps in its metadata (pre-sampled frames without video_metadata?); "
                    f"the frame timestamps in the prompt assume {DEFAULT_VIDEO_FPS} fps. Pass video_metadata for "
                    "correct timestamps. (Warned once per processor.)",
                    UserWarning,
                    stacklevel=2,
                )
                self._warned_missing_fps = True
            fps = DEFAULT_VIDEO_FPS
        if metadata.frames_indices is None:
            raise ValueError(f"video {video_idx}: the metadata has no frames_indices, so no frame timestamps")
        timestamps = [int(i) / fps for i in metadata.frames_indices][::temporal]
        if len(timestamps) != grid_t:
            raise ValueError(
                f"video {video_idx}: {len(metadata.frames_indices)} frame indices give {len(timestamps)} timestamps "
                f"but the clip has {grid_t} tubelets (video_grid_thw {[grid_t, grid_h, grid_w]})"
            )
        body = self.image_token * per_tubelet
        return "".join(f"{BEGIN_OF_IMAGE}{body}{END_OF_IMAGE}{t:.1f} seconds" for t in timestamps)

    def create_mm_token_type_ids(self, input_ids) -> list[list[int]]:
        """Per-token modality of id rows: 2 for video ``<|image|>``, 1 for other ``<|image|>``, 0 otherwise."""
        result = []
        for row in input_ids:
            ids = np.asarray(row.tolist() if hasattr(row, "tolist") else list(row), dtype=np.int64)
            inside_video = np.cumsum(ids == self.video_start_id) > np.cumsum(ids == self.video_end_id)
            result.append(np.where(ids == self.image_token_id, np.where(inside_video, 2, 1), 0).tolist())
        return result

    def _get_num_multimodal_tokens(self, image_sizes=None, video_sizes=None, **kwargs):
        """``<|image|>`` placeholder counts for images ``(h, w)`` and videos ``(frames, h, w)`` of the given sizes."""
        merged = self._merge_kwargs(**kwargs)
        data = {}
        if image_sizes is not None:
            images_kwargs = merged.get("images_kwargs", {})
            merge = images_kwargs.get("merge_size") or self.image_processor.merge_size
            patches = [self.image_processor.get_number_of_image_patches(*s, images_kwargs) for s in image_sizes]
            data["num_image_patches"] = patches
            data["num_image_tokens"] = [p // merge**2 for p in patches]
        if video_sizes is not None:
            videos_kwargs = merged.get("videos_kwargs", {})
            merge = videos_kwargs.get("merge_size") or self.video_processor.merge_size
            patches = [self.video_processor.get_num_of_video_patches(*s, videos_kwargs) for s in video_sizes]
            data["num_video_tokens"] = [p // merge**2 for p in patches]
        return MultiModalData(**data)

    @property
    def model_input_names(self):
        return super().model_input_names + ["mm_token_type_ids"]

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False, **kwargs):
        """Decode generated ids ``[B, S]`` to strings (``tokenizer.batch_decode``)."""
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens,
                                           clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``ProcessorMixin.from_pretrained`` with the sub-processors of :meth:`_get_arguments_from_pretrained`.

        Raises:
            FileNotFoundError: a local-looking path that is no folder; a local folder without tokenizer files.
        """
        path = os.fspath(pretrained_model_name_or_path)
        looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
        if looks_local and not os.path.isdir(path):
            raise FileNotFoundError(f"{path!r} is not a folder: Glm53FlashProcessor.from_pretrained needs a saved "
                                    "processor folder (or a Hub id)")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        """Load the tokenizer, the image processor (PIL backend) and the video processor of a saved processor.

        A folder without ``tokenizer_config.json`` gets its pad / EOS tokens, left padding and length limit from
        ``config.json`` (:func:`restore_missing_tokenizer_config`, with a warning).

        Raises:
            ValueError: the saved video processor is not a ``Glm53FlashVideoProcessor``; a local folder's tokenizer
                does not load (names the folder); no ``tokenizer_config.json`` and no pad / EOS id to restore.
            FileNotFoundError: a local folder without tokenizer files.
        """
        from transformers import AutoImageProcessor, AutoTokenizer

        kwargs.pop("trust_remote_code", None)
        subfolder = kwargs.pop("subfolder", "")
        folder = os.fspath(pretrained_model_name_or_path)
        folder = os.path.join(folder, subfolder) if subfolder else folder
        local = os.path.isdir(folder)
        if local and not any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{folder}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)}); save the tokenizer "
                "next to the processor (processor.save_pretrained(folder))"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        except (OSError, ValueError) as error:
            if not local:
                raise
            raise ValueError(
                f"{folder}: the tokenizer does not load ({type(error).__name__}: {str(error).splitlines()[0]})"
            ) from error
        restore_missing_tokenizer_config(tokenizer, pretrained_model_name_or_path, subfolder, **kwargs)
        image_processor = AutoImageProcessor.from_pretrained(
            pretrained_model_name_or_path, subfolder=subfolder, backend="pil", **kwargs
        )
        video_config = (processor_dict or {}).get("video_processor")
        if video_config is not None:
            saved_type = video_config.get("video_processor_type")
            if saved_type not in (None, Glm53FlashVideoProcessor.__name__):
                raise ValueError(
                    f"{pretrained_model_name_or_path}: processor_config.json names "
                    f"video_processor_type={saved_type!r}; "
                    f"Glm53FlashProcessor loads only {Glm53FlashVideoProcessor.__name__}"
                )
            config = {k: v for k, v in video_config.items() if k not in ("video_processor_type", "auto_map")}
            video_processor = Glm53FlashVideoProcessor.from_dict(config)
        else:
            video_processor = Glm53FlashVideoProcessor.from_pretrained(
                pretrained_model_name_or_path, subfolder=subfolder, **kwargs
            )
        return [image_processor, tokenizer, video_processor]

    @classmethod
    def _resolve_subprocessors(cls, pretrained_model_name_or_path, processor_dict, **kwargs):
        """transformers' loading hook from 5.25 on (earlier versions call :meth:`_get_arguments_from_pretrained`):
        ``(processor_dict with the three sub-processors of _get_arguments_from_pretrained, the kwargs for __init__)``;
        raises as that method."""
        loaded = cls._get_arguments_from_pretrained(pretrained_model_name_or_path, processor_dict, **kwargs)
        processor_dict = dict(processor_dict, **dict(zip(("image_processor", "tokenizer", "video_processor"), loaded)))
        init_args = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs", *cls.get_attributes()}
        return processor_dict, {k: v for k, v in kwargs.items() if k in init_args}


Glm53FlashProcessor.register_for_auto_class("AutoProcessor")

__all__ = ["Glm53FlashProcessor", "Glm53FlashVideoProcessor", "load_chat_template"]
