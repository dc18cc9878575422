"""Common English adjectives, nouns and verbs for RULER's keys and word lists, written for this project.

Upstream RULER draws them from the `wonderwords` package (`adjectivelist.txt`, `nounlist.txt`,
`verblist.txt`), which is not installed here. These lists play the same part: niah keys are
`adjective-noun` pairs (`ruler.key_words()`), and cwe samples its words from all three lists
(`ruler.cwe_words()`). They are plain lowercase ASCII words; the order below does not matter (the
users sort and deduplicate).
"""

from __future__ import annotations

ADJECTIVES = """
able absent abundant acid active adorable afraid aggressive agreeable alert alive amazing ancient
angry annoyed anxious aquatic arctic aromatic artistic ashamed attractive automatic average awake
aware awesome awful bad bald basic beautiful bewildered big bitter black bland blank blind blue blunt
bold boring bouncy brave breezy brief bright brilliant brisk broad broken bronze brown bumpy busy calm
capable careful careless casual cautious cheap cheerful chilly chubby clean clear clever cloudy clumsy
coarse cold colorful comfortable common complete complex confused cool cooperative courageous cozy
crazy creamy creative crisp crooked crowded cruel crunchy cuddly curious curly curved cute damaged damp
dangerous dark dazzling dead deafening deep defiant delicate delicious delightful dense dependent
determined different difficult dirty distant dizzy drab dramatic dreamy dry dull dusty eager early
earnest easy elastic elderly electric elegant elfin empty enchanted endless energetic enormous entire
envious equal even evil exact excellent excited exotic expensive extra faint fair faithful false famous
fancy fantastic far fast fat fearless feeble festive fierce filthy fine firm flaky flat flimsy fluffy
foggy foolish formal fortunate fragile fragrant frail frantic free frequent fresh friendly frightened
frosty frozen fruity full funny furry fuzzy gentle genuine giant gifted gigantic glamorous gleaming
global glossy golden good gorgeous graceful gracious grand grateful great greedy green grey grim gritty
grumpy guilty gusty hairy handsome handy happy hard harsh hasty healthy heavy helpful helpless hidden
high hollow holy homely honest hopeful horizontal hot huge humble humid hungry hurried icy ideal idle
immense important impossible innocent intense interesting jagged jealous jolly joyful juicy jumpy
keen kind knotty large late lazy lean legal light likely little lively lonely long loose loud lovely
low loyal lucky lumpy luxurious mad magical magnificent major mammoth marvelous massive mature meek
mellow melodic merry messy mighty mild mini minor misty modern modest moist muddy murky musical
mysterious narrow nasty natural naughty near neat nervous new nice nimble noble noisy normal nosy
nutty obedient obvious odd old orange ordinary organic outstanding oval plain pleasant plump polite
poor popular precious pretty prickly proud puny purple quaint quick quiet rainy rapid rare raw ready
real red regular relaxed remote rich ripe robust rocky romantic rotten rough round royal rude rural
rustic sad safe salty sandy scarce scary secret selfish serious shaggy shallow sharp shiny short shy
silent silky silly silver simple sincere skinny sleepy slim slimy slow small smart smooth snobbish
snowy soft solid sore sour spicy splendid spotless spotted square stale steady steep sticky stiff
stormy straight strange strict striped strong stupid sturdy subtle sudden sunny super sweet swift
talented tall tame tart tasty tender tense terrible thick thin thirsty thoughtful tidy tiny tired
torpid tough tranquil tricky true ugly unique upset urban useful useless vacant vague vast velvety
vibrant violet vivid warm wary weak wealthy weary wet whimsical white whole wicked wide wild windy
wise witty wobbly wonderful wooden woolly worried yellow young youthful zany zealous zesty
"""

NOUNS = """
acorn actor airport album alley almond amber anchor angle animal ankle answer ant apartment apple
apricot apron arch arm armchair army arrow artist attic aunt avenue avocado baby backpack bacon badge
bag bakery balcony ball balloon bamboo banana band bank barn barrel basket bat bath beach bead beam
bean bear beard bed bedroom bee beef beetle bell belt bench berry bicycle bird biscuit blanket blade
blossom boat body bone book boot bottle boulder bowl box boy bracelet brain branch bread breeze brick
bridge broom brother brush bubble bucket bud buffalo building bulb bull bunny burger bus bush butter
butterfly button cabin cabinet cable cactus cake camel camera camp canal candle candy cane canoe canyon
cap captain car card carpet carrot cart castle cat cattle cave ceiling cellar chain chair chalk channel
cheese cherry chess chest chicken child chimney chin chocolate church cinema circle city clam cliff
clock closet cloud clover coach coal coast coat cobweb coconut coffee coin collar comet compass cookie
copper coral corn corner cotton cottage couch country court cousin cow crab cradle crane crayon cream
creek crib cricket crow crown crystal cup cupboard curtain cushion daisy dancer deer desert desk diamond
dinner dinosaur dish doctor dog doll dolphin donkey door dragon drawer dream dress drum duck dust eagle
ear earth eel egg elbow elephant elk engine envelope eye fabric face falcon farm farmer father feather
fence fern ferry field fig finger fire fish flag flame flock floor flour flower flute fly fog forest
fork fountain fox frog fruit galaxy garage garden garlic gate gem ghost giraffe girl glacier glass
glove goat gold goose gorilla grain grape grass guitar gull hall hammer hamster hand harbor harp hat
hawk hay heart hedge helmet hen hero hill hippo hive honey hook horn horse hospital hotel house
hurricane ice igloo insect island ivory ivy jacket jaguar jam jar jelly jewel journal judge juice
kangaroo kettle key king kitchen kite kitten knee knife knot koala ladder lady lake lamb lamp lantern
leaf lemon leopard letter library lighthouse lily lion lip lizard llama lobster lock locket log lotus
magnet mailbox mango map maple marble market mask meadow melon mermaid meteor milk mill mirror mitten
monkey moon moose moss moth mother mountain mouse mouth mud muffin mug museum mushroom nail napkin
necklace needle nest net newspaper night noodle nose notebook nut oak oasis ocean octopus office olive
onion orange orchard orchid ostrich otter oven owl ox oyster paddle page pail paint palace palm
pancake panda paper parrot pasta path peach peacock peanut pear pearl pebble pelican pen pencil penguin
pepper piano pickle picture pie pig pigeon pillow pilot pine pineapple pipe pirate planet plant plate
plum pocket poem pond pony pool poppy porch pot potato pouch prince princess pumpkin puppy purse puzzle
quail queen quill quilt rabbit raccoon radio raft rain rainbow raven reef rhino ribbon rice river road
robin robot rock rocket roof room rooster root rope rose ruby rug ruler saddle sail sailor salad salmon
salt sand sandal saucer scarf school scissors scooter sea seal seed shadow shark sheep shelf shell
shield ship shirt shoe shop shovel shrimp singer sink sister skate skirt sky sled sleeve slipper snail
snake snow soap sock sofa soldier soup spider spinach sponge spoon spring squirrel stable stadium
stage star statue stone stool storm stove straw strawberry stream street string sugar suitcase sun
swamp swan sweater swing table tail teacher teapot telescope temple tent thread throne thumb ticket
tiger toast toe tomato tooth torch tortoise tower town toy tractor train tree truck trumpet tulip
tunnel turkey turtle umbrella uncle unicorn valley van vase vest village vine violin volcano wagon
wall walnut wand wardrobe wasp watch water waterfall wave whale wheat wheel whistle window wing wizard
wolf wool worm yacht yard yarn zebra zipper
"""

VERBS = """
accept add admire admit advise agree allow amuse announce answer appear applaud arrange arrive ask
attach attack avoid bake balance bang bathe battle beg behave belong blink blush boast boil bolt bounce
bow breathe bring brush build burn bury buzz calculate call camp carry carve catch challenge change
charge chase cheer chew choke chop claim clap clean climb close coach collect comb command complain
connect consider cook copy count cover crack crawl cross crush cry cure cycle dance dare decide deliver
depend describe deserve design destroy develop dig discover divide doubt drag drain draw dream dress
drift drink drip drive drop dry earn educate embrace employ empty encourage enjoy enter escape examine
excite exercise exist expand expect explain explore fade fail fancy fasten fear fetch fill film find
fit fix flap flash float flood flow fold follow force forgive frame frighten gather gaze glow glue
grab grasp greet grin grip groan growl guard guess guide hammer handle hang happen harm hate heal hear
heat help hide hop hope hover hug hum hunt hurry identify ignore imagine improve include inform
inject insist inspect instruct intend interrupt invent invite iron itch jog join joke judge juggle
jump kick kiss kneel knit knock label land last laugh launch lead lean learn lick lift light limp
listen live load lock look love manage march mark marry match measure melt mend milk miss mix moan
move mutter nail name nest nod note notice number obey observe obtain offer open order organize
overflow own pack paddle paint park pass paste pause pedal peel perform permit pick pinch plan plant
play please plug point poke polish pour pray preach prefer prepare press pretend prevent print
produce promise protect provide pull pump punch punish push question race rain raise reach read
realize receive record reduce reflect refuse relax release remain remember remind remove repair
repeat reply report rescue rest return rhyme ring rinse risk roar rob rock roll rub rule rush sail
save saw scare scatter scold scrape scratch scream scribble search settle shake share shave shelter
shine shiver shock shop shout shrug sigh sign signal sing sink skate sketch ski skip slap sleep slide
slip smash smell smile smoke snatch sneeze sniff snore soak solve sort sparkle spell spill spin
splash spoil spray sprout squash squeak squeeze stack stain stamp stare start steer step stir stitch
stop store stretch strip stroll stuff suck suffer suggest supply support suppose surprise surround
swim swing switch talk tame taste teach tease telephone tempt test thank thaw tickle tie tip tire
touch tour tow trace trade train transport trap travel treat tremble trick trip trot trust try tug
tumble turn twist type undress unfold unite unlock unpack use vanish visit wail wait walk
wander want warm warn wash waste watch water wave wear weave weigh welcome whip whirl whisper whistle
wink wipe wish wobble wonder work worry wrap wreck wrestle wriggle write yawn yell zip zoom
"""
