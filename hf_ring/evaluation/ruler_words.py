"""Word lists of hf_ring's RULER tasks (``ruler_tasks``): plain English adjectives, nouns and verbs,
written for hf_ring (RULER draws its keys and word lists from the ``wonderwords`` package's lists and an
English word list it ships; these serve the same purpose without a download).

- NIAH keys of type "words" are ``adjective-noun`` pairs (``key_words``);
- the common-words task draws distinct words from ``word_pool``: the single words first, then
  ``adjective-noun`` and ``adjective-noun-verb`` compounds when a long list needs more distinct words.
"""

from __future__ import annotations

import functools

__all__ = ["ADJECTIVES", "NOUNS", "VERBS", "key_words", "word_pool"]

ADJECTIVES = tuple(
    """
able acid aged airy alert alive ample angry ashen awake bald basic bent big bitter blank bleak blind bold
brave brief bright brisk broad broken brown busy calm candid cheap chief chilly civil clean clear clever
close cloudy coarse cold cool cosy crisp cruel curly damp dark dear deep dense dim dirty dizzy dry dull
eager early easy elder empty equal even exact faint fair false fancy far fast fat fierce fine firm flat
fluffy fond formal fragile free fresh frozen full funny gentle giant glad gloomy golden good grand grave
great green grey grim gross happy hard harsh heavy hidden high hollow honest huge humble hungry icy idle
ill jolly keen kind large late lazy lean light little live lively lone long loose loud low loyal lucky
mad major meek merry mild minor misty modern moist narrow near neat new nice noble noisy odd old open
pale plain plump polite poor proud pure quick quiet rapid rare raw ready real rich rigid ripe rough round
royal rude rural rusty sad safe salty same sandy scarce secret sharp shiny short shy silent silly simple
slim slow small smart smooth soft solid sour spare spicy stale steep stiff still stormy strange strict
strong sunny super sweet swift tall tame tender thick thin tidy tight tiny tough true ugly usual vague
vast vivid warm weak weary wet white whole wide wild windy wise witty young
""".split()
)

NOUNS = tuple(
    """
acorn actor album anchor angle ankle apple apron arch arrow attic bag bakery ball banana band barn basket
bat beach beam bean bear bed bee bell belt bench berry bike bird blanket boat bone book boot bottle bowl
box branch bread brick bridge broom brush bucket bulb bus butter button cabin cable cake camel camera
candle canoe cap car card carpet carrot castle cat cave chair chalk cheese cherry chest chicken chimney
circle city clock cloud coat coin comet cookie copper corn cotton couch crab crayon crown cup curtain
daisy desk diamond dinner dog doll door dragon drum duck eagle earth egg elbow engine eraser fabric
feather fence field finger fish flag flame flower flute forest fork fountain fox frog garden gate ghost
gift glass glove goat grape grass guitar hammer harbor hat hill honey horse hotel house island jacket jar
jelly jewel kettle key kite kitten ladder lake lamp leaf lemon letter lion lizard lock map marble meadow
melon mirror monkey moon mountain mouse mug nail needle nest net ocean olive onion orange owl paint
pancake paper parrot pearl pencil pepper piano pillow pipe planet plate pocket pond potato puzzle quilt
rabbit radio rain ribbon river road robot rocket roof rope rose sail salad sand scarf school shell ship
shoe shovel silver sink sky sled snail snake soap sock spoon star stone stove sugar sun table teapot
tent thread tiger toast tomato tower train tree truck tulip tunnel turtle umbrella valley vase violin
wagon wall wallet whale wheel window wing wolf wool yard zebra
""".split()
)

VERBS = tuple(
    """
accept add admire allow answer argue arrive ask bake balance battle beg behave belong bless blink boil
borrow bounce brake breathe build bump burn call carry carve catch chase cheer chew clap climb collect
comb cook copy count cover crawl cross cry dance deliver dig dive drag draw dream dress drink drive drop
dust earn enjoy enter escape explain fetch fill fix float fold follow gather gaze glow grab greet grin
guard guess hang hop hug hunt hurry iron jog join juggle jump kick kneel knit knock land laugh lift
listen march melt mend mix nod obey offer open pack paint park pass pause plant play point polish pour
pray print pull push race rest ride ring roll rush sail scrub search sew shake share shout sing sit
skate sketch skip sleep slide smile sneeze sniff snore spell spill spin splash stack stamp stir stretch
swim swing talk taste teach tickle travel trip trot tug turn type unlock vanish visit wade walk wander
wash watch wave weave whisper whistle wink wish wobble work wrap write yawn yell zoom
""".split()
)


@functools.cache
def key_words() -> tuple[str, ...]:
    """Every ``adjective-noun`` pair, sorted: the keys of NIAH needles of type "words"."""
    return tuple(sorted(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS))


def word_pool(count: int) -> list[str]:
    """``count`` distinct words: the single words (sorted), then ``adjective-noun`` compounds, then
    ``adjective-noun-verb`` ones."""
    singles = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
    if count <= len(singles):
        return singles[:count]
    pool = singles + list(key_words())
    if count <= len(pool):
        return pool[:count]
    extra = (f"{a}-{n}-{v}" for v in VERBS for a in ADJECTIVES for n in NOUNS)
    pool += [next(extra) for _ in range(count - len(pool))]
    return pool
