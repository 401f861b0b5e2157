#!/usr/bin/env python3
"""Generate the JPEG decoder-routing test corpus in this folder.

    python3 make.py            # (re)write every *.jpg here, byte-identical each run
    python3 make.py --verify   # decode with Pillow + dump markers, writes nothing

Needs Python 3 with Pillow and numpy.  Picture content is computed with integer
arithmetic only (no RNG, no libm), so it is identical on every machine.  Most
files are encoded by Pillow (libjpeg-turbo).  Pillow cannot write 4:4:0 or
4:1:1, so those two are written by the small baseline encoder below
(`encode_baseline`), which reuses the quantisation and Huffman tables that
Pillow itself writes at quality 90, so they match the Pillow baseline files.
"""
import io
import os
import sys

import numpy as np
from PIL import Image, ImageFile

HERE = os.path.dirname(os.path.abspath(__file__))
M32 = np.uint64(0xFFFFFFFF)


# --------------------------------------------------------------------------
# Deterministic synthetic "photo": gradients + sharp edges + hashed noise.
# --------------------------------------------------------------------------
def _hash_noise(x, y, seed, amp):
    """Integer hash noise in [-amp, amp]; no RNG so it is portable."""
    h = (x.astype(np.uint64) * np.uint64(73856093)) ^ (y.astype(np.uint64) * np.uint64(19349663))
    h = (h ^ np.uint64(seed * 83492791)) & M32
    h = (h ^ (h >> np.uint64(13))) & M32
    h = (h * np.uint64(0x5BD1E995)) & M32
    h = (h ^ (h >> np.uint64(15))) & M32
    return (h % np.uint64(2 * amp + 1)).astype(np.int64) - amp


def picture(w, h, seed, noise=8):
    y, x = np.mgrid[0:h, 0:w].astype(np.int64)
    wd, hd = max(w - 1, 1), max(h - 1, 1)
    # smooth parts
    r = 30 + (190 * x) // wd
    g = 20 + (200 * y) // hd
    cx, cy = (13 * w) // 20, (7 * h) // 20
    rad2 = max((w * w + h * h) // 4, 1)
    d2 = np.minimum(((x - cx) ** 2 + (y - cy) ** 2) * 1024 // rad2, 1024)
    b = 235 - d2 * 200 // 1024
    # sharp edges: a half plane flips green, a dark rectangle, a thin ring, stripes
    half = 3 * x - 2 * y > (3 * w) // 2
    g = np.where(half, 255 - g, g)
    rect = (x >= w // 8) & (x < (3 * w) // 8) & (y >= h // 2) & (y < (7 * h) // 8)
    r = np.where(rect, 200, r)
    g = np.where(rect, 40 + (x % 7), g)
    b = np.where(rect, 35, b)
    rr = max(min(w, h) // 5, 1)
    ring = np.abs((x - w // 4) ** 2 + (y - h // 4) ** 2 - rr * rr) <= 2 * rr
    r, g, b = (np.where(ring, 12, c) for c in (r, g, b))
    stripes = (x >= (3 * w) // 4) & (y >= (5 * h) // 8) & ((x // 2) % 2 == 0)
    r, g, b = (np.where(stripes, 245, c) for c in (r, g, b))
    # noise
    out = [c + _hash_noise(x, y, seed * 3 + i + 1, noise) for i, c in enumerate((r, g, b))]
    return np.clip(np.stack(out, axis=-1), 0, 255).astype(np.uint8)


def rgb_image(w, h, seed, noise=8):
    return Image.fromarray(picture(w, h, seed, noise), "RGB")


def cmyk_image(w, h, seed):
    a = picture(w, h, seed).astype(np.int64)
    k = 255 - a.max(axis=-1)
    den = np.maximum(255 - k, 1)
    cmy = [((255 - a[..., i] - k) * 255 + den // 2) // den for i in range(3)]
    arr = np.stack(cmy + [k], axis=-1)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "CMYK")


def pil_jpeg(im, **kw):
    buf = io.BytesIO()
    im.save(buf, "JPEG", **kw)
    return buf.getvalue()


# --------------------------------------------------------------------------
# JPEG marker parsing (used by the encoder to borrow tables, and by --verify)
# --------------------------------------------------------------------------
def parse(data):
    """Return list of (marker, payload) and scan facts. Tolerates bad files."""
    segs, scans = [], []
    i = 2 if data[:2] == b"\xff\xd8" else 0
    while i + 1 < len(data):
        if data[i] != 0xFF:
            break
        while i + 1 < len(data) and data[i + 1] == 0xFF:
            i += 1
        m = data[i + 1]
        if m == 0xD9 or 0xD0 <= m <= 0xD7 or m == 0x01:
            segs.append((m, b""))
            i += 2
            continue
        if i + 4 > len(data):
            break
        ln = int.from_bytes(data[i + 2 : i + 4], "big")
        segs.append((m, data[i + 4 : i + 2 + ln]))
        i += 2 + ln
        if m == 0xDA:
            j, rst = i, 0
            while j + 1 < len(data):
                if data[j] == 0xFF and data[j + 1] != 0 and data[j + 1] != 0xFF:
                    if 0xD0 <= data[j + 1] <= 0xD7:
                        rst += 1
                        j += 2
                        continue
                    break
                j += 1
            else:
                j = len(data)
            scans.append({"start": i, "end": j, "rst": rst})
            i = j
    return segs, scans


def std_tables(quality=90):
    """Quantisation (zigzag order) and Huffman tables exactly as Pillow writes them."""
    segs, _ = parse(pil_jpeg(rgb_image(16, 16, 0), quality=quality, subsampling="4:2:0"))
    qt, ht = {}, {}
    for m, p in segs:
        if m == 0xDB:
            k = 0
            while k < len(p):
                assert p[k] >> 4 == 0  # 8-bit tables
                qt[p[k] & 15] = list(p[k + 1 : k + 65])
                k += 65
        elif m == 0xC4:
            k = 0
            while k < len(p):
                tc_th, bits = p[k], list(p[k + 1 : k + 17])
                n = sum(bits)
                ht[(tc_th >> 4, tc_th & 15)] = (bits, list(p[k + 17 : k + 17 + n]))
                k += 17 + n
    return qt, ht


# --------------------------------------------------------------------------
# Minimal baseline (SOF0) encoder for sampling factors Pillow cannot write.
# Integer DCT arithmetic only, so the output is bit-exact everywhere.
# --------------------------------------------------------------------------
def _zigzag():
    cells = [(i, j) for i in range(8) for j in range(8)]
    cells.sort(key=lambda c: (c[0] + c[1], c[0] if (c[0] + c[1]) % 2 else -c[0]))
    return np.array([i * 8 + j for i, j in cells])


ZZ = _zigzag()  # ZZ[k] = natural (row-major) index of zigzag position k


def _huff_codes(bits, vals):
    codes, code, k = {}, 0, 0
    for length in range(1, 17):
        for _ in range(bits[length - 1]):
            codes[vals[k]] = (code, length)
            code += 1
            k += 1
        code <<= 1
    return codes


class _Bits:
    def __init__(self):
        self.out, self.acc, self.n = bytearray(), 0, 0

    def put(self, code, length):
        self.acc = (self.acc << length) | code
        self.n += length
        while self.n >= 8:
            self.n -= 8
            b = (self.acc >> self.n) & 0xFF
            self.out.append(b)
            if b == 0xFF:
                self.out.append(0)
        self.acc &= (1 << self.n) - 1

    def flush(self):
        if self.n:
            self.put((1 << (8 - self.n)) - 1, 8 - self.n)


def _seg(marker, payload):
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def encode_baseline(im, luma_hv, quality=90):
    """Encode RGB `im` as baseline YCbCr JPEG, Y sampled (H,V)=luma_hv, Cb/Cr 1x1."""
    qt, ht = std_tables(quality)
    w, h = im.size
    a = np.asarray(im, dtype=np.float64)
    R, G, B = a[..., 0], a[..., 1], a[..., 2]
    ycc = [
        0.299 * R + 0.587 * G + 0.114 * B,
        -0.168736 * R - 0.331264 * G + 0.5 * B + 128.0,
        0.5 * R - 0.418688 * G - 0.081312 * B + 128.0,
    ]
    ycc = [np.clip(np.floor(p + 0.5), 0, 255).astype(np.int64) for p in ycc]
    hmax, vmax = luma_hv
    comps = [(1, luma_hv, 0), (2, (1, 1), 1), (3, (1, 1), 1)]
    mw, mh = 8 * hmax, 8 * vmax
    mcux, mcuy = -(-w // mw), -(-h // mh)
    # integer DCT matrix, scaled by 2^12
    C = np.array([[(np.sqrt(0.5) if u == 0 else 1.0) / 2 * np.cos((2 * x + 1) * u * np.pi / 16)
                   for x in range(8)] for u in range(8)])
    Ci = np.round(C * 4096).astype(np.int64)
    coefs = []
    for (cid, (H, V), tq), plane in zip(comps, ycc):
        p = np.pad(plane, ((0, mcuy * mh - h), (0, mcux * mw - w)), mode="edge")
        fy, fx = vmax // V, hmax // H
        n = fx * fy
        p = (p.reshape(p.shape[0] // fy, fy, p.shape[1] // fx, fx).sum(axis=(1, 3)) + n // 2) // n
        by, bx = p.shape[0] // 8, p.shape[1] // 8
        blk = p.reshape(by, 8, bx, 8).transpose(0, 2, 1, 3) - 128
        d = np.matmul(np.matmul(Ci, blk), Ci.T)  # int64 exact
        q = np.empty(64, dtype=np.int64)
        q[ZZ] = qt[tq]
        den = q.reshape(8, 8) << 24
        qd = np.sign(d) * ((np.abs(d) + den // 2) // den)
        coefs.append(qd.reshape(by, bx, 64)[..., ZZ])
    dc = [_huff_codes(*ht[(0, 0)]), _huff_codes(*ht[(0, 1)])]
    ac = [_huff_codes(*ht[(1, 0)]), _huff_codes(*ht[(1, 1)])]
    bw = _Bits()
    pred = [0, 0, 0]

    def mag(v):
        s = abs(v).bit_length()
        return s, (v if v >= 0 else v + (1 << s) - 1)

    for my in range(mcuy):
        for mx in range(mcux):
            for ci, (cid, (H, V), tq) in enumerate(comps):
                for v in range(V):
                    for hh in range(H):
                        z = [int(t) for t in coefs[ci][my * V + v, mx * H + hh]]
                        s, bits = mag(z[0] - pred[ci])
                        pred[ci] = z[0]
                        bw.put(*dc[tq][s])
                        if s:
                            bw.put(bits, s)
                        run = 0
                        for k in range(1, 64):
                            if z[k] == 0:
                                run += 1
                                continue
                            while run > 15:
                                bw.put(*ac[tq][0xF0])
                                run -= 16
                            s, bits = mag(z[k])
                            bw.put(*ac[tq][(run << 4) | s])
                            bw.put(bits, s)
                            run = 0
                        if run:
                            bw.put(*ac[tq][0x00])
    bw.flush()
    out = b"\xff\xd8" + _seg(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    out += _seg(0xDB, bytes([0] + qt[0] + [1] + qt[1]))
    sof = bytes([8]) + h.to_bytes(2, "big") + w.to_bytes(2, "big") + bytes([3])
    for cid, (H, V), tq in comps:
        sof += bytes([cid, (H << 4) | V, tq])
    out += _seg(0xC0, sof)
    for tc, th in ((0, 0), (1, 0), (0, 1), (1, 1)):
        bits, vals = ht[(tc, th)]
        out += _seg(0xC4, bytes([(tc << 4) | th] + bits + vals))
    out += _seg(0xDA, bytes([3, 1, 0x00, 2, 0x11, 3, 0x11, 0, 63, 0]))
    return out + bytes(bw.out) + b"\xff\xd9"


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------
def build():
    f = {}
    q = dict(quality=90)
    f["baseline_444.jpg"] = pil_jpeg(rgb_image(123, 77, 1), subsampling="4:4:4", **q)
    f["baseline_422.jpg"] = pil_jpeg(rgb_image(200, 131, 2), subsampling="4:2:2", **q)
    f["baseline_420.jpg"] = pil_jpeg(rgb_image(97, 160, 3), subsampling="4:2:0", **q)
    f["baseline_440.jpg"] = encode_baseline(rgb_image(123, 77, 4), (1, 2))
    f["baseline_411.jpg"] = encode_baseline(rgb_image(200, 131, 5), (4, 1))
    f["gray.jpg"] = pil_jpeg(rgb_image(123, 77, 6).convert("L"), **q)
    f["cmyk.jpg"] = pil_jpeg(cmyk_image(97, 160, 7), **q)
    f["progressive_420.jpg"] = pil_jpeg(rgb_image(200, 131, 8), subsampling="4:2:0", progressive=True, **q)
    f["progressive_444.jpg"] = pil_jpeg(rgb_image(123, 77, 9), subsampling="4:4:4", progressive=True, **q)
    # 200x131 4:2:0 -> 13x9 MCUs; interval of 5 MCUs deliberately crosses MCU-row ends
    f["restart_420.jpg"] = pil_jpeg(rgb_image(200, 131, 10), subsampling="4:2:0", restart_marker_blocks=5, **q)
    f["optimized_420.jpg"] = pil_jpeg(rgb_image(123, 77, 11), subsampling="4:2:0", optimize=True, **q)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    f["exif_rotated.jpg"] = pil_jpeg(rgb_image(200, 131, 12), subsampling="4:2:0", exif=exif.tobytes(), **q)
    f["tiny_1x1.jpg"] = pil_jpeg(rgb_image(1, 1, 13), subsampling="4:2:0", **q)
    f["tiny_8x8.jpg"] = pil_jpeg(rgb_image(8, 8, 14), subsampling="4:2:0", **q)
    f["large_odd.jpg"] = pil_jpeg(rgb_image(1021, 767, 15, noise=4), subsampling="4:2:0", quality=85)

    # ---- bad files, all derived from baseline_420.jpg / tiny_8x8.jpg ----
    base = f["baseline_420.jpg"]
    f["truncated.jpg"] = base[: len(base) // 2]
    _, scans = parse(base)
    start = scans[0]["start"] + 64  # 64 bytes into the entropy-coded data
    assert base[start - 1] != 0xFF and scans[0]["end"] - start > 400
    pat, s = bytearray(), 0x1234567
    for _ in range(200):
        s = (s * 1103515245 + 12345) & 0x7FFFFFFF
        pat.append((s >> 16) % 255)  # never 0xFF, so no fake markers
    f["corrupt_huffman.jpg"] = base[:start] + bytes(pat) + base[start + 200 :]
    assert base.endswith(b"\xff\xd9")
    f["no_eoi.jpg"] = base[:-2]
    tiny = bytearray(f["tiny_8x8.jpg"])
    i = tiny.index(b"\xff\xc0")
    tiny[i + 5 : i + 9] = (65000).to_bytes(2, "big") * 2  # height, width
    f["huge_header.jpg"] = bytes(tiny)
    return f




def verify():
    import hashlib
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    bad = {"truncated.jpg", "corrupt_huffman.jpg", "no_eoi.jpg", "huge_header.jpg"}
    names = sorted(n for n in os.listdir(HERE) if n.endswith(".jpg"))
    total = 0
    std_ht = std_tables()[1]
    for n in names:
        data = open(os.path.join(HERE, n), "rb").read()
        total += len(data)
        segs, scans = parse(data)
        sof = [(m, p) for m, p in segs if m in (0xC0, 0xC1, 0xC2)]
        facts = []
        for m, p in sof:
            hgt, wid, nc = int.from_bytes(p[1:3], "big"), int.from_bytes(p[3:5], "big"), p[5]
            samp = ",".join(f"{p[6 + 3 * c + 1] >> 4}x{p[6 + 3 * c + 1] & 15}" for c in range(nc))
            facts.append(f"SOF{m - 0xC0} {wid}x{hgt} nc={nc} samp={samp}")
        dri = [int.from_bytes(p[:2], "big") for m, p in segs if m == 0xDD]
        if dri:
            facts.append(f"DRI={dri[0]}")
        fhts = {}
        for m, p in segs:
            k = 0
            while m == 0xC4 and k < len(p):
                cnt = sum(p[k + 1 : k + 17])
                fhts[(p[k] >> 4, p[k] & 15)] = (list(p[k + 1 : k + 17]), list(p[k + 17 : k + 17 + cnt]))
                k += 17 + cnt
        if fhts:
            facts.append("DHT=std" if all(std_ht.get(k) == v for k, v in fhts.items()) else "DHT=custom")
        facts.append(f"scans={len(scans)}")
        rst = sum(s["rst"] for s in scans)
        if rst:
            facts.append(f"RST={rst}")
        if any(m == 0xE1 and p.startswith(b"Exif\0\0") for m, p in segs):
            facts.append("APP1-Exif")
        for m, p in segs:
            if m == 0xEE and p.startswith(b"Adobe"):
                facts.append(f"APP14-Adobe(transform={p[11]})")
        facts.append("EOI" if data.endswith(b"\xff\xd9") else "noEOI")
        try:
            with Image.open(os.path.join(HERE, n)) as im:
                im.load()
                pil = f"OK {im.mode} {im.size[0]}x{im.size[1]}"
                if n == "exif_rotated.jpg":
                    pil += f" orientation={im.getexif().get(0x0112)}"
        except Exception as e:  # noqa: BLE001
            pil = f"FAIL {type(e).__name__}: {e}"
        tag = "BAD " if n in bad else "good"
        print(f"{tag} {n:22s} {len(data):6d}B {hashlib.sha256(data).hexdigest()[:12]} | "
              f"{' '.join(facts)} | Pillow: {pil}")
    print(f"total {total} bytes in {len(names)} files")


def fidelity():
    """PSNR of each good file vs. the source picture (checks the custom encoder)."""
    src = {
        "baseline_444.jpg": (123, 77, 1), "baseline_422.jpg": (200, 131, 2),
        "baseline_420.jpg": (97, 160, 3), "baseline_440.jpg": (123, 77, 4),
        "baseline_411.jpg": (200, 131, 5), "progressive_420.jpg": (200, 131, 8),
        "optimized_420.jpg": (123, 77, 11), "restart_420.jpg": (200, 131, 10),
    }
    for n, (w, h, s) in src.items():
        ref = picture(w, h, s).astype(np.float64)
        got = np.asarray(Image.open(os.path.join(HERE, n)).convert("RGB"), dtype=np.float64)
        mse = ((ref - got) ** 2).mean()
        print(f"  PSNR {n:20s} {10 * np.log10(255 ** 2 / mse):5.1f} dB")


def main():
    if "--verify" in sys.argv:
        verify()
        fidelity()
        return
    for name, data in build().items():
        with open(os.path.join(HERE, name), "wb") as fh:
            fh.write(data)
        print(f"wrote {name} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
