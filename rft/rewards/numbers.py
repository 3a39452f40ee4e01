"""The number a GSM8K-style answer ends with, as the `last_number` reward and its maj@n vote read it.

One reader for both, so that the reward and the vote never disagree about what a response said.
What counts as a number (the README's verifier table says the same):

- digits, with an optional decimal point: `42`, `2.50`, `.5` and `5.` (a sentence's full stop is
  not part of it); any Unicode decimal digits (`٥` and full-width `５` are 5, as Python's `int`
  reads them); a number inside a word counts (`x2` reads 2, `5kg` 5);
- a sign: `-5`, `−5` (U+2212), `－5`; `+5` is 5; a minus right after a digit is a subtraction or a
  range, not a sign (`5-7` ends with 7, not -7);
- thousands: groups of three digits after a comma, a no-break or a thin space (`1,000`,
  `1 000` with U+202F), one separator throughout, or the Indian grouping (`1,23,456` is 123456);
  a plain space separates two numbers (`1 000` is 1 and 000), and so does a comma between other
  groups (`1,2,3` is 1, 2, 3);
  a decimal comma is not read (`2,5` is 2 and 5);
- scientific notation is one number: `1e16`, `1.5E-3`, `1.5 × 10^16`, `1.5\\times 10^{16}`;
  a power of integers too (`2^10` is 1024, `10^{-3}` is 0.001), while its digits stay under
  10,000;
- a fraction of two unsigned decimals is its value: `1/2` is 0.5, `-3/4` is -0.75, the mixed
  number `1 1/2` 1.5; `1/0` is no number;
- `nan`, `inf` and number words are not numbers.

Values compare exactly (`Decimal`, cross-multiplied for fractions: no float rounding, no digit
limit), and the vote's spelling (`spelling`) is one string per value (`0.5` for `1/2`, `.5` and
`5e-1`). A number too large to work with (an exponent over 10**15, a power of over 10,000 digits,
a fraction with a side of over 10,000 digits) is no number: the response has no answer and
scores 0. The cost is linear in the response's length: a megabyte of digits is one number.
"""

from __future__ import annotations

import re
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal
from fractions import Fraction

_MINUS = "\\-\u2212\uff0d\ufe63"  # escaped: inside [+...] a bare - made a range from + to U+2212 (letters too)
_EXP = rf"[+{_MINUS}]?\d+"
_TIMES = r"\s*(?:[×xX*·⋅]|\\times|\\cdot)\s*"
_NUMBER = re.compile(
    rf"(?P<sign>(?<!\d)[{_MINUS}])?"
    rf"(?:(?<![\d.])(?P<whole>\d{{1,10}})[ \u00a0](?=\d+/\d))?"  # a mixed number: 1 1/2
    rf"(?P<dec>\d{{1,3}}(?P<sep>[,\u00a0\u2009\u202f])\d{{3}}(?:(?P=sep)\d{{3}})*+(?!\d)(?:\.\d++)?"
    rf"|(?P<lakh>\d{{1,2}}(?:,\d{{2}})+,\d{{3}})(?!\d)(?:\.\d++)?"  # Indian grouping: 1,23,456
    rf"|\d++(?:\.\d++)?|(?<![\d.])\.\d++)"
    rf"(?:\^\{{?(?P<pow>{_EXP})\}}?"  # 2^10, 10^{{-3}}
    rf"|/(?P<den>\d++(?:\.\d++)?)"  # 1/2
    rf"|[eE](?P<e>{_EXP})|{_TIMES}10\^\{{?(?P<e10>{_EXP})\}}?)?"  # 1e16, 1.5 x 10^16
)
_EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN)  # no rounding: products of exact values
_MAX_EXPONENT = 10**15
_MAX_DIGITS = 10_000


def _int(text: str) -> int | None:
    """An exponent's text as an int (any minus sign, any script's digits), None beyond 18 digits."""
    text = text.translate(_SIGNS)
    return int(text) if len(text.lstrip("+-")) <= 18 else None


_SIGNS = str.maketrans({c: "-" for c in "\u2212\uff0d\ufe63"})


def _power(base: str, power: str) -> tuple[Decimal, Decimal] | None:
    """base ** power, exact, as (numerator, denominator); None when it has too many digits."""
    b = _int(power)
    if b is None or len(base) > _MAX_DIGITS:
        return None
    coefficient, exp = _coefficient(Decimal(base))
    if coefficient == 0:
        return None if b < 0 else (Decimal(0) if b else Decimal(1), Decimal(1))
    digits = 0 if coefficient == 1 else len(str(Decimal(coefficient)))  # 10^k is a shift, of any k
    if digits * abs(b) > _MAX_DIGITS or abs(exp * b) > _MAX_EXPONENT:
        return None
    value = _EXACT.scaleb(Decimal(coefficient ** abs(b)), exp * abs(b))
    return (value, Decimal(1)) if b >= 0 else (Decimal(1), value)


def _coefficient(d: Decimal) -> tuple[int, int]:
    """|d| as (an integer without trailing zeros, its power of ten); ints made without str(), which
    refuses over 4300 digits."""
    _, digits, exp = d.as_tuple()
    n = int(Decimal((0, digits, 0)))
    while n and n % 10 == 0:
        n, exp = n // 10, exp + 1
    return n, exp


def _value(m: re.Match) -> tuple[Decimal, Decimal] | None:
    """A match's exact value as (numerator, denominator > 0), None for no number."""
    dec = m["dec"].replace(m["sep"] or ",", "") if m["sep"] or m["lakh"] else m["dec"]
    if m["pow"] is not None:
        value = _power(dec, m["pow"])
    elif m["den"] is not None:
        if max(len(dec), len(m["den"])) > _MAX_DIGITS or Decimal(m["den"]) == 0:
            return None
        value = Decimal(dec), Decimal(m["den"])
        if m["whole"] and value[0] < value[1]:  # 1 1/2 is 3/2; 3 7/2 is two numbers, the last 7/2
            value = _EXACT.add(_EXACT.multiply(Decimal(m["whole"]), value[1]), value[0]), value[1]
    else:
        dec = Decimal(dec)
        shift = m["e"] or m["e10"]
        if shift is not None:
            k = _int(shift)
            if k is None or abs(k) > _MAX_EXPONENT:
                return None
            dec = _EXACT.scaleb(dec, k)
        value = dec, Decimal(1)
    if value is None:
        return None
    return (value[0].copy_negate(), value[1]) if m["sign"] else value  # copy_negate: no context, no Overflow


def last_value(text: str) -> tuple[Decimal, Decimal] | None:
    """The exact value of the last number in `text` (as the module says), None when there is none
    or the last one is too large to work with."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None else _value(last)


def equal(a: tuple[Decimal, Decimal], b: tuple[Decimal, Decimal]) -> bool:
    """Whether two values of `last_value` are one number (exactly)."""
    if a[1] == 1 and b[1] == 1:
        return a[0] == b[0]
    return _EXACT.multiply(a[0], b[1]) == _EXACT.multiply(b[0], a[1])


def _decimal_spelling(negative: bool, digits: str, exp: int) -> str:
    """digits x 10**exp, written one way: no leading or trailing zeros, a point only where needed,
    `e` only beyond 100 zeros ("007.50" -> "7.5", "-0.0" -> "0", 1e16 -> "10000000000000000")."""
    digits = digits.lstrip("0")
    stripped = digits.rstrip("0")
    exp += len(digits) - len(stripped)
    digits = stripped
    if not digits:
        return "0"
    sign = "-" if negative else ""
    if 0 <= exp <= 100:
        return sign + digits + "0" * exp
    if exp < 0 and -exp < len(digits):
        return sign + digits[:exp] + "." + digits[exp:]
    if exp < 0 and -exp - len(digits) <= 100:
        return sign + "0." + "0" * (-exp - len(digits)) + digits
    return sign + digits[0] + ("." + digits[1:] if digits[1:] else "") + f"e{exp + len(digits) - 1}"


def _fraction_spelling(value: tuple[Decimal, Decimal]) -> str:
    """A fraction's one spelling: a decimal when it has one (1/2 -> 0.5), else reduced (2/6 -> 1/3),
    with its power of ten apart only beyond 100 digits (`1/3e-200`)."""
    (n, ne), (d, de) = _coefficient(value[0]), _coefficient(value[1])
    r = Fraction(n, d)
    p, q, exp = r.numerator, r.denominator, ne - de
    twos = fives = 0
    while q % 2 == 0:
        q, twos = q // 2, twos + 1
    while q % 5 == 0:
        q, fives = q // 5, fives + 1
    k = max(twos, fives)
    p, exp = p * 2 ** (k - twos) * 5 ** (k - fives), exp - k  # p/q x 10**exp, q prime to 10
    negative = value[0] < 0
    if q == 1:
        return _decimal_spelling(negative, str(Decimal(p)), exp)
    sign = "-" if negative else ""
    if abs(exp) <= 100:
        f = Fraction(p * 10 ** max(exp, 0), q * 10 ** max(-exp, 0))
        return f"{sign}{Decimal(f.numerator)}/{Decimal(f.denominator)}"
    while p % 10 == 0:
        p, exp = p // 10, exp + 1
    return f"{sign}{Decimal(p)}/{Decimal(q)}e{exp}"


def spelling(value: tuple[Decimal, Decimal]) -> str:
    """One string per value of `last_value` (two values are `equal` iff their spellings are)."""
    if value[1] == 1:
        sign, digits, exp = value[0].as_tuple()
        return _decimal_spelling(bool(sign), "".join(map(str, digits)), exp)
    return _fraction_spelling(value)
