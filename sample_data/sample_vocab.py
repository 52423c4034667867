"""Word lists for `make_samples.py`: vendors, names, cities, products and ticket texts (data, not code)."""

VENDORS = [
    "Acme Office Supply", "Northwind Traders", "Bluebird Logistics", "Globex Consulting", "Initech Software",
    "Stark Industrial", "Brightline Cleaning", "Pioneer Freight", "Summit Catering", "Harbor Print Co",
    "Evergreen Landscaping", "Cobalt Cloud Hosting", "Redwood Legal LLP", "Maple Electric", "Orion Security",
    "Lumen Marketing", "Quarry Stone Works", "Atlas Staffing", "Nimbus Telecom", "Falcon Courier",
]

FIRST = [
    "James", "Mary", "Robert", "Patricia", "John", "Jennifer", "Michael", "Linda", "David", "Elizabeth",
    "William", "Barbara", "Richard", "Susan", "Joseph", "Jessica", "Thomas", "Sarah", "Oliver", "Amelia",
    "Harry", "Isla", "George", "Ava", "Noah", "Emily", "Jack", "Sophie", "Charlie", "Grace", "Priya",
    "Mohammed", "Chloe", "Lucas", "Mia", "Ethan", "Zara", "Daniel", "Hannah", "Samuel",
]

LAST = [
    "Smith", "Johnson", "Williams", "Brown", "Jones", "Garcia", "Miller", "Davis", "Rodriguez", "Martinez",
    "Wilson", "Anderson", "Taylor", "Thomas", "Moore", "Jackson", "Martin", "Lee", "Thompson", "White",
    "Evans", "Walker", "Wright", "Robinson", "Hughes", "Patel", "Khan", "Murphy", "O'Brien", "Clarke",
]

CITIES_US = ["New York", "Los Angeles", "Chicago", "Houston", "Phoenix", "Seattle", "Denver", "Boston",
             "Austin", "Portland", "San Diego", "Atlanta"]
CITIES_UK = ["London", "Manchester", "Birmingham", "Leeds", "Glasgow", "Bristol", "Liverpool", "Edinburgh",
             "Cardiff", "Nottingham"]


def _p(brand: str, model: str, spec: str, color: str, price: float) -> dict:
    return dict(brand=brand, model=model, spec=spec, color=color, price=price)


PRODUCTS = [
    _p("Apple", "iPhone 13", "128 GB", "Midnight", 599.0), _p("Apple", "iPhone 13", "256 GB", "Midnight", 699.0),
    _p("Apple", "iPhone 13", "128 GB", "Starlight", 599.0), _p("Apple", "iPhone 15 Pro", "256 GB", "Natural", 1099.0),
    _p("Apple", "AirPods Pro", "2nd Gen", "White", 249.0), _p("Apple", "AirPods Pro", "1st Gen", "White", 179.0),
    _p("Samsung", "Galaxy S23", "128 GB", "Phantom Black", 799.0),
    _p("Samsung", "Galaxy S23", "256 GB", "Phantom Black", 859.0),
    _p("Samsung", "Galaxy S23", "128 GB", "Cream", 799.0), _p("Samsung", "Galaxy Buds2 Pro", "", "Graphite", 229.0),
    _p("Sony", "WH-1000XM5", "Wireless", "Black", 399.0), _p("Sony", "WH-1000XM4", "Wireless", "Black", 279.0),
    _p("Sony", "WH-1000XM5", "Wireless", "Silver", 399.0), _p("Sony", "PlayStation 5", "Disc Edition", "White", 499.0),
    _p("Sony", "PlayStation 5", "Digital Edition", "White", 449.0),
    _p("Logitech", "MX Master 3S", "Wireless Mouse", "Graphite", 99.0),
    _p("Logitech", "MX Master 3S", "Wireless Mouse", "Pale Grey", 99.0),
    _p("Logitech", "MX Keys", "Wireless Keyboard", "Graphite", 119.0),
    _p("Dell", "XPS 13", "16GB RAM 512GB SSD", "Platinum", 1199.0),
    _p("Dell", "XPS 13", "8GB RAM 256GB SSD", "Platinum", 949.0),
    _p("Lenovo", "ThinkPad X1 Carbon Gen 11", "16GB 512GB", "Black", 1649.0),
    _p("Lenovo", "ThinkPad X1 Carbon Gen 10", "16GB 512GB", "Black", 1399.0),
    _p("Nintendo", "Switch OLED", "64 GB", "White", 349.0), _p("Nintendo", "Switch OLED", "64 GB", "Neon", 349.0),
    _p("Bose", "QuietComfort 45", "Headphones", "Black", 329.0),
    _p("Bose", "QuietComfort Ultra", "Headphones", "Black", 429.0),
    _p("Kindle", "Paperwhite", "16 GB", "Black", 149.0), _p("Kindle", "Paperwhite", "8 GB", "Black", 129.0),
    _p("Anker", "PowerCore 20000", "Power Bank", "Black", 49.0), _p("Anker", "PowerCore 10000", "Power Bank", "Black", 29.0),
]

# (subject, body) pairs with {placeholders} filled by make_samples.tickets
TICKET_BUG = [
    ("{feature} is broken", "Since this morning {feature} shows {error} when I click it in {browser}. "
     "I tried clearing the cache and logging out, same thing. Can you fix it?"),
    ("Crash when using {feature}", "The app crashes every time I open {feature}. Steps: log in, open "
     "{feature}, wait two seconds. Using {browser}. It worked last week."),
    ("Error: {error}", "Getting {error} on {feature}. Happens for everyone on my team, on {browser} too."),
    ("{feature} not saving changes", "When I edit anything in {feature} and press save, nothing happens and "
     "after a reload my changes are gone. No error message. {browser}."),
    ("Data missing after update", "After yesterday's update {feature} no longer shows any of my records, "
     "it just loads {error}. This blocks our whole workflow."),
    ("Wrong numbers in {feature}", "The totals in {feature} do not add up: the sum shown is different from "
     "the rows above it. Looks like a calculation bug, seen on {browser}."),
]
TICKET_BILLING = [
    ("Charged twice this month", "I was charged {amount} twice on my card for the {plan} plan in {month}. "
     "Please refund the duplicate payment."),
    ("Refund request", "I cancelled my {plan} subscription but was still billed {amount}. I would like a "
     "refund please."),
    ("Invoice for {month}", "Could you send me a proper VAT invoice for the {amount} payment made in {month}? "
     "Our accountant needs the company address on it."),
    ("Upgrade to {plan}", "We want to move from our current plan to {plan}. How will the price difference be "
     "charged, and will I get a prorated bill?"),
    ("Card declined", "My payment of {amount} keeps getting declined although the card is valid. How else can "
     "I pay for the {plan} plan?"),
    ("Cancel my subscription", "Please cancel my {plan} subscription at the end of {month} and stop charging "
     "my credit card."),
]
TICKET_OTHER = [
    ("Feature request: dark mode", "Love the product! Any plans to add a dark mode to {feature}? It would "
     "help a lot when working late."),
    ("How do I add a teammate?", "I am new here. How can I invite a colleague to our workspace and give them "
     "access to {feature}?"),
    ("Partnership inquiry", "Hi, I run a small agency and would like to talk about a reseller partnership. "
     "Who is the right person to contact?"),
    ("Thanks!", "Just wanted to say your support team was great last week when we set up {feature}. Keep it up."),
    ("Documentation question", "Is there a guide for using {feature} with our own data? I could not find it "
     "in the help center."),
    ("Change account email", "How do I change the email address on my account? I am moving to a new company "
     "domain next {month}."),
]
