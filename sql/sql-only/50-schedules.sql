-- Schedules (schedule.rs): cron expressions read as the extension's cron parser reads them (five
-- fields are minutes, six start with seconds; lists, ranges, steps, names, L, #, W, ?, +, and
-- the @nicknames), ticks computed in the schedule's time zone with the same rules at DST
-- changes, and the ticks due on a queue enqueued by its leases and locks.
--
-- A dropped queue takes its schedules with it through the extension's sql_drop event trigger,
-- which only a superuser may create: this build creates it when a superuser installs it. Without
-- it, a dropped queue's schedules stay behind: they are never listed and never fire, and the next
-- inbox_schedule, inbox_unschedule or firing deletes them.

-- A parsed cron expression: seconds, minutes and hours as sorted arrays (searched in order), the
-- other fields as masks of one bit per value: months 1-12, days of month 1-31, weekdays 0-6
-- (Sunday is 0).
DO $$
BEGIN
    IF pg_catalog.to_regtype('inbox__cron') IS NULL THEN
        CREATE TYPE inbox__cron AS (
            pattern text,          -- as the parser normalised it, for messages
            seconds int[],
            minutes int[],
            hours int[],
            months int,
            dom_all bigint,        -- listed days
            dom_closest bigint,    -- days given as nW
            dom_last bool,         -- L
            dom_last_weekday bool, -- LW
            dow_all int,
            dow_nth int[],         -- [n]: weekdays given as d#n
            dow_last int,          -- weekdays given as dL or d#L
            star_dom bool,
            star_dow bool,
            dom_and_dow bool,
            fixed bool             -- one second, minute and hour: fires once at DST changes
        );
    END IF;
END
$$;

-- The names chrono-tz (the extension's time zone database) knows, exactly as it spells them.
CREATE OR REPLACE FUNCTION inbox__time_zone_known(zone text) RETURNS bool
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN zone = ANY ('{Africa/Abidjan,Africa/Accra,Africa/Addis_Ababa,Africa/Algiers,Africa/Asmara,Africa/Asmera,
Africa/Bamako,Africa/Bangui,Africa/Banjul,Africa/Bissau,Africa/Blantyre,Africa/Brazzaville,
Africa/Bujumbura,Africa/Cairo,Africa/Casablanca,Africa/Ceuta,Africa/Conakry,Africa/Dakar,
Africa/Dar_es_Salaam,Africa/Djibouti,Africa/Douala,Africa/El_Aaiun,Africa/Freetown,
Africa/Gaborone,Africa/Harare,Africa/Johannesburg,Africa/Juba,Africa/Kampala,Africa/Khartoum,
Africa/Kigali,Africa/Kinshasa,Africa/Lagos,Africa/Libreville,Africa/Lome,Africa/Luanda,
Africa/Lubumbashi,Africa/Lusaka,Africa/Malabo,Africa/Maputo,Africa/Maseru,Africa/Mbabane,
Africa/Mogadishu,Africa/Monrovia,Africa/Nairobi,Africa/Ndjamena,Africa/Niamey,
Africa/Nouakchott,Africa/Ouagadougou,Africa/Porto-Novo,Africa/Sao_Tome,Africa/Timbuktu,
Africa/Tripoli,Africa/Tunis,Africa/Windhoek,America/Adak,America/Anchorage,America/Anguilla,
America/Antigua,America/Araguaina,America/Argentina/Buenos_Aires,America/Argentina/Catamarca,
America/Argentina/ComodRivadavia,America/Argentina/Cordoba,America/Argentina/Jujuy,
America/Argentina/La_Rioja,America/Argentina/Mendoza,America/Argentina/Rio_Gallegos,
America/Argentina/Salta,America/Argentina/San_Juan,America/Argentina/San_Luis,
America/Argentina/Tucuman,America/Argentina/Ushuaia,America/Aruba,America/Asuncion,
America/Atikokan,America/Atka,America/Bahia,America/Bahia_Banderas,America/Barbados,
America/Belem,America/Belize,America/Blanc-Sablon,America/Boa_Vista,America/Bogota,
America/Boise,America/Buenos_Aires,America/Cambridge_Bay,America/Campo_Grande,America/Cancun,
America/Caracas,America/Catamarca,America/Cayenne,America/Cayman,America/Chicago,
America/Chihuahua,America/Ciudad_Juarez,America/Coral_Harbour,America/Cordoba,
America/Costa_Rica,America/Coyhaique,America/Creston,America/Cuiaba,America/Curacao,
America/Danmarkshavn,America/Dawson,America/Dawson_Creek,America/Denver,America/Detroit,
America/Dominica,America/Edmonton,America/Eirunepe,America/El_Salvador,America/Ensenada,
America/Fort_Nelson,America/Fort_Wayne,America/Fortaleza,America/Glace_Bay,America/Godthab,
America/Goose_Bay,America/Grand_Turk,America/Grenada,America/Guadeloupe,America/Guatemala,
America/Guayaquil,America/Guyana,America/Halifax,America/Havana,America/Hermosillo,
America/Indiana/Indianapolis,America/Indiana/Knox,America/Indiana/Marengo,
America/Indiana/Petersburg,America/Indiana/Tell_City,America/Indiana/Vevay,
America/Indiana/Vincennes,America/Indiana/Winamac,America/Indianapolis,America/Inuvik,
America/Iqaluit,America/Jamaica,America/Jujuy,America/Juneau,America/Kentucky/Louisville,
America/Kentucky/Monticello,America/Knox_IN,America/Kralendijk,America/La_Paz,America/Lima,
America/Los_Angeles,America/Louisville,America/Lower_Princes,America/Maceio,America/Managua,
America/Manaus,America/Marigot,America/Martinique,America/Matamoros,America/Mazatlan,
America/Mendoza,America/Menominee,America/Merida,America/Metlakatla,America/Mexico_City,
America/Miquelon,America/Moncton,America/Monterrey,America/Montevideo,America/Montreal,
America/Montserrat,America/Nassau,America/New_York,America/Nipigon,America/Nome,
America/Noronha,America/North_Dakota/Beulah,America/North_Dakota/Center,
America/North_Dakota/New_Salem,America/Nuuk,America/Ojinaga,America/Panama,America/Pangnirtung,
America/Paramaribo,America/Phoenix,America/Port-au-Prince,America/Port_of_Spain,
America/Porto_Acre,America/Porto_Velho,America/Puerto_Rico,America/Punta_Arenas,
America/Rainy_River,America/Rankin_Inlet,America/Recife,America/Regina,America/Resolute,
America/Rio_Branco,America/Rosario,America/Santa_Isabel,America/Santarem,America/Santiago,
America/Santo_Domingo,America/Sao_Paulo,America/Scoresbysund,America/Shiprock,America/Sitka,
America/St_Barthelemy,America/St_Johns,America/St_Kitts,America/St_Lucia,America/St_Thomas,
America/St_Vincent,America/Swift_Current,America/Tegucigalpa,America/Thule,America/Thunder_Bay,
America/Tijuana,America/Toronto,America/Tortola,America/Vancouver,America/Virgin,
America/Whitehorse,America/Winnipeg,America/Yakutat,America/Yellowknife,Antarctica/Casey,
Antarctica/Davis,Antarctica/DumontDUrville,Antarctica/Macquarie,Antarctica/Mawson,
Antarctica/McMurdo,Antarctica/Palmer,Antarctica/Rothera,Antarctica/South_Pole,Antarctica/Syowa,
Antarctica/Troll,Antarctica/Vostok,Arctic/Longyearbyen,Asia/Aden,Asia/Almaty,Asia/Amman,
Asia/Anadyr,Asia/Aqtau,Asia/Aqtobe,Asia/Ashgabat,Asia/Ashkhabad,Asia/Atyrau,Asia/Baghdad,
Asia/Bahrain,Asia/Baku,Asia/Bangkok,Asia/Barnaul,Asia/Beirut,Asia/Bishkek,Asia/Brunei,
Asia/Calcutta,Asia/Chita,Asia/Choibalsan,Asia/Chongqing,Asia/Chungking,Asia/Colombo,Asia/Dacca,
Asia/Damascus,Asia/Dhaka,Asia/Dili,Asia/Dubai,Asia/Dushanbe,Asia/Famagusta,Asia/Gaza,
Asia/Harbin,Asia/Hebron,Asia/Ho_Chi_Minh,Asia/Hong_Kong,Asia/Hovd,Asia/Irkutsk,Asia/Istanbul,
Asia/Jakarta,Asia/Jayapura,Asia/Jerusalem,Asia/Kabul,Asia/Kamchatka,Asia/Karachi,Asia/Kashgar,
Asia/Kathmandu,Asia/Katmandu,Asia/Khandyga,Asia/Kolkata,Asia/Krasnoyarsk,Asia/Kuala_Lumpur,
Asia/Kuching,Asia/Kuwait,Asia/Macao,Asia/Macau,Asia/Magadan,Asia/Makassar,Asia/Manila,
Asia/Muscat,Asia/Nicosia,Asia/Novokuznetsk,Asia/Novosibirsk,Asia/Omsk,Asia/Oral,
Asia/Phnom_Penh,Asia/Pontianak,Asia/Pyongyang,Asia/Qatar,Asia/Qostanay,Asia/Qyzylorda,
Asia/Rangoon,Asia/Riyadh,Asia/Saigon,Asia/Sakhalin,Asia/Samarkand,Asia/Seoul,Asia/Shanghai,
Asia/Singapore,Asia/Srednekolymsk,Asia/Taipei,Asia/Tashkent,Asia/Tbilisi,Asia/Tehran,
Asia/Tel_Aviv,Asia/Thimbu,Asia/Thimphu,Asia/Tokyo,Asia/Tomsk,Asia/Ujung_Pandang,
Asia/Ulaanbaatar,Asia/Ulan_Bator,Asia/Urumqi,Asia/Ust-Nera,Asia/Vientiane,Asia/Vladivostok,
Asia/Yakutsk,Asia/Yangon,Asia/Yekaterinburg,Asia/Yerevan,Atlantic/Azores,Atlantic/Bermuda,
Atlantic/Canary,Atlantic/Cape_Verde,Atlantic/Faeroe,Atlantic/Faroe,Atlantic/Jan_Mayen,
Atlantic/Madeira,Atlantic/Reykjavik,Atlantic/South_Georgia,Atlantic/St_Helena,Atlantic/Stanley,
Australia/ACT,Australia/Adelaide,Australia/Brisbane,Australia/Broken_Hill,Australia/Canberra,
Australia/Currie,Australia/Darwin,Australia/Eucla,Australia/Hobart,Australia/LHI,
Australia/Lindeman,Australia/Lord_Howe,Australia/Melbourne,Australia/NSW,Australia/North,
Australia/Perth,Australia/Queensland,Australia/South,Australia/Sydney,Australia/Tasmania,
Australia/Victoria,Australia/West,Australia/Yancowinna,Brazil/Acre,Brazil/DeNoronha,
Brazil/East,Brazil/West,CET,CST6CDT,Canada/Atlantic,Canada/Central,Canada/Eastern,
Canada/Mountain,Canada/Newfoundland,Canada/Pacific,Canada/Saskatchewan,Canada/Yukon,
Chile/Continental,Chile/EasterIsland,Cuba,EET,EST,EST5EDT,Egypt,Eire,Etc/GMT,Etc/GMT+0,
Etc/GMT+1,Etc/GMT+10,Etc/GMT+11,Etc/GMT+12,Etc/GMT+2,Etc/GMT+3,Etc/GMT+4,Etc/GMT+5,Etc/GMT+6,
Etc/GMT+7,Etc/GMT+8,Etc/GMT+9,Etc/GMT-0,Etc/GMT-1,Etc/GMT-10,Etc/GMT-11,Etc/GMT-12,Etc/GMT-13,
Etc/GMT-14,Etc/GMT-2,Etc/GMT-3,Etc/GMT-4,Etc/GMT-5,Etc/GMT-6,Etc/GMT-7,Etc/GMT-8,Etc/GMT-9,
Etc/GMT0,Etc/Greenwich,Etc/UCT,Etc/UTC,Etc/Universal,Etc/Zulu,Europe/Amsterdam,Europe/Andorra,
Europe/Astrakhan,Europe/Athens,Europe/Belfast,Europe/Belgrade,Europe/Berlin,Europe/Bratislava,
Europe/Brussels,Europe/Bucharest,Europe/Budapest,Europe/Busingen,Europe/Chisinau,
Europe/Copenhagen,Europe/Dublin,Europe/Gibraltar,Europe/Guernsey,Europe/Helsinki,
Europe/Isle_of_Man,Europe/Istanbul,Europe/Jersey,Europe/Kaliningrad,Europe/Kiev,Europe/Kirov,
Europe/Kyiv,Europe/Lisbon,Europe/Ljubljana,Europe/London,Europe/Luxembourg,Europe/Madrid,
Europe/Malta,Europe/Mariehamn,Europe/Minsk,Europe/Monaco,Europe/Moscow,Europe/Nicosia,
Europe/Oslo,Europe/Paris,Europe/Podgorica,Europe/Prague,Europe/Riga,Europe/Rome,Europe/Samara,
Europe/San_Marino,Europe/Sarajevo,Europe/Saratov,Europe/Simferopol,Europe/Skopje,Europe/Sofia,
Europe/Stockholm,Europe/Tallinn,Europe/Tirane,Europe/Tiraspol,Europe/Ulyanovsk,Europe/Uzhgorod,
Europe/Vaduz,Europe/Vatican,Europe/Vienna,Europe/Vilnius,Europe/Volgograd,Europe/Warsaw,
Europe/Zagreb,Europe/Zaporozhye,Europe/Zurich,GB,GB-Eire,GMT,GMT+0,GMT-0,GMT0,Greenwich,HST,
Hongkong,Iceland,Indian/Antananarivo,Indian/Chagos,Indian/Christmas,Indian/Cocos,Indian/Comoro,
Indian/Kerguelen,Indian/Mahe,Indian/Maldives,Indian/Mauritius,Indian/Mayotte,Indian/Reunion,
Iran,Israel,Jamaica,Japan,Kwajalein,Libya,MET,MST,MST7MDT,Mexico/BajaNorte,Mexico/BajaSur,
Mexico/General,NZ,NZ-CHAT,Navajo,PRC,PST8PDT,Pacific/Apia,Pacific/Auckland,
Pacific/Bougainville,Pacific/Chatham,Pacific/Chuuk,Pacific/Easter,Pacific/Efate,
Pacific/Enderbury,Pacific/Fakaofo,Pacific/Fiji,Pacific/Funafuti,Pacific/Galapagos,
Pacific/Gambier,Pacific/Guadalcanal,Pacific/Guam,Pacific/Honolulu,Pacific/Johnston,
Pacific/Kanton,Pacific/Kiritimati,Pacific/Kosrae,Pacific/Kwajalein,Pacific/Majuro,
Pacific/Marquesas,Pacific/Midway,Pacific/Nauru,Pacific/Niue,Pacific/Norfolk,Pacific/Noumea,
Pacific/Pago_Pago,Pacific/Palau,Pacific/Pitcairn,Pacific/Pohnpei,Pacific/Ponape,
Pacific/Port_Moresby,Pacific/Rarotonga,Pacific/Saipan,Pacific/Samoa,Pacific/Tahiti,
Pacific/Tarawa,Pacific/Tongatapu,Pacific/Truk,Pacific/Wake,Pacific/Wallis,Pacific/Yap,Poland,
Portugal,ROC,ROK,Singapore,Turkey,UCT,US/Alaska,US/Aleutian,US/Arizona,US/Central,
US/East-Indiana,US/Eastern,US/Hawaii,US/Indiana-Starke,US/Michigan,US/Mountain,US/Pacific,
US/Samoa,UTC,Universal,W-SU,WET,Zulu}'::text[]);

CREATE OR REPLACE FUNCTION inbox__cron_invalid(cron text, problem text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = '22023',
        MESSAGE = format('invalid cron expression "%s": %s', cron, problem);
END
$$;

-- A decimal number as the cron parser reads one (digits only, at most max), else NULL.
CREATE OR REPLACE FUNCTION inbox__cron_number(digits text, max int) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN CASE WHEN digits ~ '^[0-9]+$' AND ltrim(digits, '0') ~ '^[0-9]{0,5}$'
                 AND ('0' || ltrim(digits, '0'))::int <= max
            THEN ('0' || ltrim(digits, '0'))::int END;

-- One field of a cron expression (croner's CronComponent::parse). masks[1] holds the plain values,
-- masks[2..6] the #1..#5 weekdays, masks[7] the L weekdays, masks[8] the W days.
CREATE OR REPLACE FUNCTION inbox__cron_field(cron text, field text, lo int, hi int, nth_allowed bool,
    OUT masks bigint[], OUT last_enabled bool, OUT closest_enabled bool, OUT step int,
    OUT from_wildcard bool)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    part text;
    bit int;        -- index into masks
    clean text;
    bounds text[];
    first int;
    last int;
    stride int;
    nth int;
    value int;
    problem text;
BEGIN
    masks := '{0,0,0,0,0,0,0,0}';
    last_enabled := false;
    closest_enabled := false;
    step := 1;
    from_wildcard := false;
    IF field = '*' THEN
        from_wildcard := true;
        FOR value IN lo..hi LOOP
            masks[1] := masks[1] | (1::bigint << value);
        END LOOP;
        RETURN;
    END IF;
    FOREACH part IN ARRAY string_to_array(field, ',') LOOP
        CONTINUE WHEN part = '';
        problem := NULL;
        IF strpos(part, '/') = 0 AND strpos(part, '-') = 0 AND strpos(part, 'W') > 0 THEN
            -- nW: the weekday closest to day n; LW: the month's last weekday.
            clean := split_part(part, 'W', 1);
            IF clean = 'L' THEN
                last_enabled := true;
                closest_enabled := true;
                CONTINUE;
            END IF;
            value := inbox__cron_number(clean, 65535);
            IF value IS NULL THEN
                problem := 'Invalid day for closest weekday.';
            ELSIF value < lo OR value > hi THEN
                problem := 'Day for closest weekday out of bounds.';
            ELSE
                masks[8] := masks[8] | (1::bigint << value);
                CONTINUE;
            END IF;
        ELSIF strpos(part, '/') = 0 AND strpos(part, '-') = 0 AND part = 'L' THEN
            last_enabled := true;
            CONTINUE;
        ELSE
            IF strpos(part, '/') = 0 AND strpos(part, '-') = 0 THEN
                IF right(part, 1) = 'L' AND strpos(part, '#') = 0 THEN
                    part := replace(part, 'L', '#L');
                END IF;
                IF strpos(part, '#') > 0 AND NOT nth_allowed THEN
                    PERFORM inbox__cron_invalid(cron,
                        'Component error: Nth specifier # not allowed in the current field.');
                END IF;
                IF strpos(part, 'L') > 0 AND NOT nth_allowed THEN
                    PERFORM inbox__cron_invalid(cron,
                        'Component error: L not allowed in the current field.');
                END IF;
            END IF;
            -- Which occurrence: dL or d#L the last, d#n the nth, else every one.
            IF right(part, 1) = 'L' THEN
                bit := 7;
            ELSIF strpos(part, '#') > 0 THEN
                nth := inbox__cron_number(substr(part, strpos(part, '#') + 1), 255);
                IF nth IS NULL THEN
                    PERFORM inbox__cron_invalid(cron, 'Component error: Invalid nth specifier.');
                ELSIF nth = 0 OR nth > 5 THEN
                    PERFORM inbox__cron_invalid(cron, 'Component error: Nth specifier out of bounds.');
                END IF;
                bit := 1 + nth;
            ELSE
                bit := 1;
            END IF;
            clean := split_part(part, '#', 1);
            IF strpos(part, '/') > 0 THEN
                bounds := string_to_array(clean, '/');
                IF cardinality(bounds) <> 2 THEN
                    problem := 'Invalid stepped range syntax.';
                ELSE
                    stride := inbox__cron_number(bounds[2], 65535);
                    IF stride IS NULL THEN
                        problem := 'Invalid step.';
                    ELSE
                        step := stride;
                        IF stride = 0 THEN
                            problem := 'Step cannot be zero.';
                        ELSIF bounds[1] = '*' THEN
                            from_wildcard := true;
                            first := lo;
                            last := hi;
                        ELSIF strpos(bounds[1], '-') > 0 THEN
                            IF cardinality(string_to_array(bounds[1], '-')) <> 2 THEN
                                problem := 'Invalid range syntax in stepping.';
                            ELSE
                                first := inbox__cron_number(split_part(bounds[1], '-', 1), 65535);
                                last := inbox__cron_number(split_part(bounds[1], '-', 2), 65535);
                                IF first IS NULL THEN
                                    problem := 'Invalid range start.';
                                ELSIF last IS NULL THEN
                                    problem := 'Invalid range end.';
                                END IF;
                            END IF;
                        ELSIF bounds[1] = '' THEN
                            problem := format('Invalid step syntax: omitting the starting point like "/%1$s" is not allowed. Use "*/%1$s" for wildcard steps or "X-Y/%1$s" for range steps.', bounds[2]);
                        ELSE
                            problem := format('Invalid step syntax: single number steps like "%1$s/%2$s" are not allowed. Use "*/%2$s" for wildcard steps or "X-Y/%2$s" for range steps.', bounds[1], bounds[2]);
                        END IF;
                        IF problem IS NULL AND (first < lo OR last > hi OR first > last) THEN
                            problem := 'Range is out of bounds in stepping.';
                        END IF;
                        IF problem IS NULL THEN
                            value := first;
                            WHILE value <= last LOOP
                                masks[bit] := masks[bit] | (1::bigint << value);
                                IF value + stride > 65535 THEN
                                    problem := 'Value exceeded max after stepping.';
                                    EXIT;
                                END IF;
                                value := value + stride;
                            END LOOP;
                        END IF;
                    END IF;
                END IF;
            ELSIF strpos(part, '-') > 0 THEN
                bounds := string_to_array(clean, '-');
                IF cardinality(bounds) <> 2 THEN
                    problem := 'Invalid range syntax.';
                ELSE
                    first := inbox__cron_number(bounds[1], 65535);
                    last := inbox__cron_number(bounds[2], 65535);
                    IF first IS NULL THEN
                        problem := 'Invalid start of range.';
                    ELSIF last IS NULL THEN
                        problem := 'Invalid end of range.';
                    ELSIF first > last OR first < lo OR last > hi THEN
                        problem := 'Range out of bounds.';
                    ELSE
                        FOR value IN first..last LOOP
                            masks[bit] := masks[bit] | (1::bigint << value);
                        END LOOP;
                    END IF;
                END IF;
            ELSE
                value := inbox__cron_number(clean, 65535);
                IF value IS NULL THEN
                    problem := 'Invalid number.';
                ELSIF value < lo OR value > hi THEN
                    problem := 'Number out of bounds.';
                ELSE
                    masks[bit] := masks[bit] | (1::bigint << value);
                END IF;
            END IF;
        END IF;
        IF problem IS NOT NULL THEN
            PERFORM inbox__cron_invalid(cron, 'Component error: ' || problem);
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION inbox__cron_values(mask bigint, lo int, hi int) RETURNS int[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN ARRAY(SELECT v FROM generate_series(lo, hi) AS v WHERE mask & (1::bigint << v) <> 0 ORDER BY v);

-- Parses a cron expression as Timetable::parse configures croner (seconds optional, no year),
-- raising 22023 with croner's message.
CREATE OR REPLACE FUNCTION inbox__cron_parse(cron text) RETURNS inbox__cron
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    pattern text;
    parts text[];
    allowed text;
    bad text;
    c inbox__cron;
    f record;
    fixed bool := true;
    i int;
    name text[];
BEGIN
    pattern := regexp_replace(upper(cron), '^\s+|\s+$', '', 'g');
    IF pattern = '' THEN
        PERFORM inbox__cron_invalid(cron, 'CronPattern cannot be an empty string.');
    END IF;
    IF strpos(pattern, '@') > 0 THEN
        pattern := CASE pattern
            WHEN '@YEARLY' THEN '0 0 1 1 *' WHEN '@ANNUALLY' THEN '0 0 1 1 *'
            WHEN '@MONTHLY' THEN '0 0 1 * *' WHEN '@WEEKLY' THEN '0 0 * * SUN'
            WHEN '@DAILY' THEN '0 0 * * *' WHEN '@HOURLY' THEN '0 * * * *'
            ELSE pattern END;
    END IF;
    FOREACH name SLICE 1 IN ARRAY ARRAY[['-SUN', '-7'], ['SUN', '0'], ['MON', '1'], ['TUE', '2'],
            ['WED', '3'], ['THU', '4'], ['FRI', '5'], ['SAT', '6'], ['JAN', '1'], ['FEB', '2'],
            ['MAR', '3'], ['APR', '4'], ['MAY', '5'], ['JUN', '6'], ['JUL', '7'], ['AUG', '8'],
            ['SEP', '9'], ['OCT', '10'], ['NOV', '11'], ['DEC', '12']] LOOP
        pattern := replace(pattern, name[1], name[2]);
    END LOOP;
    c.pattern := pattern;
    parts := regexp_split_to_array(pattern, '\s+');
    IF cardinality(parts) = 5 THEN
        parts := '0'::text || parts;
    END IF;
    IF cardinality(parts) <> 6 THEN
        PERFORM inbox__cron_invalid(cron,
            'Invalid pattern: Pattern must have 5 or 6 fields when years are disallowed.');
    END IF;
    parts[4] := replace(parts[4], '?', '*');
    parts[6] := replace(parts[6], '?', '*');
    c.dom_and_dow := left(parts[6], 1) = '+';
    IF c.dom_and_dow THEN
        parts[6] := substr(parts[6], 2);
    END IF;
    FOR i IN 1..6 LOOP
        allowed := CASE i WHEN 4 THEN '[^*/0-9,LW?-]' WHEN 6 THEN '[^*/0-9,#L?-]' ELSE '[^*/0-9,-]' END;
        bad := substring(parts[i] FROM allowed);
        IF bad IS NOT NULL THEN
            PERFORM inbox__cron_invalid(cron, format(
                'Pattern contains illegal characters: CronPattern contains illegal character ''%s'' in part ''%s''',
                bad, parts[i]));
        END IF;
    END LOOP;
    c.star_dom := parts[4] = '*';
    c.star_dow := parts[6] = '*';
    f := inbox__cron_field(cron, parts[1], 0, 59, false);
    c.seconds := inbox__cron_values(f.masks[1], 0, 59);
    fixed := fixed AND f.step = 1 AND NOT f.from_wildcard AND cardinality(c.seconds) = 1;
    f := inbox__cron_field(cron, parts[2], 0, 59, false);
    c.minutes := inbox__cron_values(f.masks[1], 0, 59);
    fixed := fixed AND f.step = 1 AND NOT f.from_wildcard AND cardinality(c.minutes) = 1;
    f := inbox__cron_field(cron, parts[3], 0, 23, false);
    c.hours := inbox__cron_values(f.masks[1], 0, 23);
    fixed := fixed AND f.step = 1 AND NOT f.from_wildcard AND cardinality(c.hours) = 1;
    c.fixed := fixed;
    f := inbox__cron_field(cron, parts[4], 1, 31, false);
    c.dom_all := f.masks[1];
    c.dom_closest := f.masks[8];
    c.dom_last := f.last_enabled AND NOT f.closest_enabled;
    c.dom_last_weekday := f.last_enabled AND f.closest_enabled;
    f := inbox__cron_field(cron, parts[5], 1, 12, false);
    c.months := f.masks[1];
    f := inbox__cron_field(cron, parts[6], 0, 7, true);
    -- 7 is Sunday too.
    c.dow_all := ((f.masks[1] | (f.masks[1] >> 7)) & 127)::int;
    c.dow_nth := ARRAY[((f.masks[2] | (f.masks[2] >> 7)) & 127)::int,
                       ((f.masks[3] | (f.masks[3] >> 7)) & 127)::int,
                       ((f.masks[4] | (f.masks[4] >> 7)) & 127)::int,
                       ((f.masks[5] | (f.masks[5] >> 7)) & 127)::int,
                       ((f.masks[6] | (f.masks[6] >> 7)) & 127)::int];
    c.dow_last := ((f.masks[7] | (f.masks[7] >> 7)) & 127)::int;
    RETURN c;
END
$$;

-- The days (bit n for day n) of a month of `length` days whose 1st is weekday `first_weekday`
-- that the expression's day fields select (croner's CronPattern::day_match).
CREATE OR REPLACE FUNCTION inbox__cron_days(c inbox__cron, first_weekday int, length int)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    month_days constant bigint := ((1::bigint << (length + 1)) - 1) & ~1::bigint;
    by_day bigint := c.dom_all;
    by_weekday bigint := 0;
    day int;
    weekday int;
    target int;
BEGIN
    IF c.dom_last_weekday THEN
        weekday := (first_weekday + length - 1) % 7;
        by_day := by_day | (1::bigint << (length - CASE weekday WHEN 6 THEN 1 WHEN 0 THEN 2 ELSE 0 END));
    ELSIF c.dom_last THEN
        by_day := by_day | (1::bigint << length);
    END IF;
    IF c.dom_closest <> 0 THEN
        FOR day IN 1..length LOOP
            CONTINUE WHEN c.dom_closest & (1::bigint << day) = 0;
            weekday := (first_weekday + day - 1) % 7;
            target := CASE
                WHEN weekday BETWEEN 1 AND 5 THEN day
                WHEN weekday = 6 AND day > 1 THEN day - 1
                WHEN weekday = 6 THEN day + 2
                WHEN day < length THEN day + 1
                ELSE day - 2 END;
            by_day := by_day | (1::bigint << target);
        END LOOP;
    END IF;
    IF c.dow_all <> 0 OR c.dow_last <> 0 OR c.dow_nth <> '{0,0,0,0,0}' THEN
        FOR day IN 1..length LOOP
            weekday := 1 << ((first_weekday + day - 1) % 7);
            IF c.dow_all & weekday <> 0 OR c.dow_nth[(day - 1) / 7 + 1] & weekday <> 0
               OR (c.dow_last & weekday <> 0 AND day + 7 > length) THEN
                by_weekday := by_weekday | (1::bigint << day);
            END IF;
        END LOOP;
    END IF;
    by_day := by_day & month_days;
    RETURN CASE
        WHEN c.star_dom AND c.star_dow THEN by_day | by_weekday
        WHEN c.star_dow THEN by_day
        WHEN c.star_dom THEN by_weekday
        WHEN c.dom_and_dow THEN by_day & by_weekday
        ELSE by_day | by_weekday END;
END
$$;

-- Whether the expression's day and month fields select `day`.
CREATE OR REPLACE FUNCTION inbox__cron_date_matches(c inbox__cron, day date) RETURNS bool
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN c.months & (1 << extract(month FROM day)::int) <> 0
   AND inbox__cron_days(c, extract(dow FROM date_trunc('month', day::timestamp))::int,
                        extract(day FROM date_trunc('month', day::timestamp)
                                         + interval '1 month - 1 day')::int)
       & (1::bigint << extract(day FROM day)::int) <> 0;

-- The first time of day (in seconds) at or after `second_of_day` that the expression selects,
-- or the last at or before it when not `forward`; NULL when there is none that day.
CREATE OR REPLACE FUNCTION inbox__cron_time(c inbox__cron, second_of_day int, forward bool)
RETURNS int
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    hour0 constant int := second_of_day / 3600;
    minute0 constant int := second_of_day / 60 % 60;
    second0 constant int := second_of_day % 60;
    hours int[] := c.hours;
    minutes int[] := c.minutes;
    seconds int[] := c.seconds;
    h int;
    m int;
    s int;
BEGIN
    IF cardinality(hours) = 0 OR cardinality(minutes) = 0 OR cardinality(seconds) = 0 THEN
        RETURN NULL;
    END IF;
    IF NOT forward THEN
        hours := ARRAY(SELECT v FROM unnest(hours) AS v ORDER BY v DESC);
        minutes := ARRAY(SELECT v FROM unnest(minutes) AS v ORDER BY v DESC);
        seconds := ARRAY(SELECT v FROM unnest(seconds) AS v ORDER BY v DESC);
    END IF;
    FOREACH h IN ARRAY hours LOOP
        CONTINUE WHEN CASE WHEN forward THEN h < hour0 ELSE h > hour0 END;
        IF h <> hour0 THEN
            RETURN h * 3600 + minutes[1] * 60 + seconds[1];
        END IF;
        FOREACH m IN ARRAY minutes LOOP
            CONTINUE WHEN CASE WHEN forward THEN m < minute0 ELSE m > minute0 END;
            IF m <> minute0 THEN
                RETURN h * 3600 + m * 60 + seconds[1];
            END IF;
            FOREACH s IN ARRAY seconds LOOP
                IF (forward AND s >= second0) OR (NOT forward AND s <= second0) THEN
                    RETURN h * 3600 + m * 60 + s;
                END IF;
            END LOOP;
        END LOOP;
    END LOOP;
    RETURN NULL;
END
$$;

-- The first local time at or after `start` (or the last at or before it) that the expression
-- selects, month by month. NULL when there is none: the calendar repeats every 400 years, so a
-- search that long finds every tick there is; and none before `stop` when going back.
CREATE OR REPLACE FUNCTION inbox__cron_wall(c inbox__cron, start timestamp, forward bool,
    stop timestamp) RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    month date := date_trunc('month', start)::date;
    first_day int := extract(day FROM start)::int;
    first_second int := extract(epoch FROM start::time)::int;
    months_left int := 400 * 12 + 1;
    by_shape bigint[] := '{}';  -- day masks by (weekday of the 1st, length)
    shape int;
    weekday int;
    length int;
    days bigint;
    day int;
    second int;
BEGIN
    IF cardinality(c.hours) = 0 OR cardinality(c.minutes) = 0 OR cardinality(c.seconds) = 0 THEN
        RETURN NULL;
    END IF;
    LOOP
        months_left := months_left - 1;
        IF months_left < 0 OR extract(year FROM month) > 5000 OR extract(year FROM month) < 1
           OR (stop IS NOT NULL AND month + interval '1 month' <= stop) THEN
            RETURN NULL;
        END IF;
        IF c.months & (1 << extract(month FROM month)::int) <> 0 THEN
            weekday := extract(dow FROM month)::int;
            length := extract(day FROM month + interval '1 month - 1 day')::int;
            shape := weekday * 4 + length - 27;
            days := by_shape[shape];
            IF days IS NULL THEN
                days := inbox__cron_days(c, weekday, length);
                by_shape[shape] := days;
            END IF;
            IF days <> 0 THEN
                IF forward THEN
                    FOR day IN COALESCE(first_day, 1)..length LOOP
                        CONTINUE WHEN days & (1::bigint << day) = 0;
                        second := inbox__cron_time(c, CASE WHEN day = first_day THEN first_second ELSE 0 END, true);
                        IF second IS NOT NULL THEN
                            RETURN month + (day - 1) + make_interval(secs => second);
                        END IF;
                    END LOOP;
                ELSE
                    FOR day IN REVERSE LEAST(COALESCE(first_day, length), length)..1 LOOP
                        CONTINUE WHEN days & (1::bigint << day) = 0;
                        second := inbox__cron_time(c, CASE WHEN day = first_day THEN first_second ELSE 86399 END, false);
                        IF second IS NOT NULL THEN
                            RETURN month + (day - 1) + make_interval(secs => second);
                        END IF;
                    END LOOP;
                END IF;
            END IF;
        END IF;
        first_day := NULL;
        month := CASE WHEN forward THEN month + interval '1 month' ELSE month - interval '1 month' END;
    END LOOP;
END
$$;

-- The UTC offset of `zone` at `instant`.
CREATE OR REPLACE FUNCTION inbox__zone_offset(instant timestamptz, zone text) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN (instant AT TIME ZONE zone) - (instant AT TIME ZONE 'UTC');

-- The first instant after `before` whose offset is that of `after` (one change between them).
CREATE OR REPLACE FUNCTION inbox__zone_change(before timestamptz, after timestamptz, zone text)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    target constant interval := inbox__zone_offset(after, zone);
    middle timestamptz;
BEGIN
    WHILE after - before > interval '1 second' LOOP
        middle := before + (after - before) / 2;
        middle := date_trunc('second', middle);
        IF middle <= before THEN
            middle := before + interval '1 second';
        END IF;
        IF inbox__zone_offset(middle, zone) = target THEN
            after := middle;
        ELSE
            before := middle;
        END IF;
    END LOOP;
    RETURN after;
END
$$;

-- The instants of local time `wall` in `zone`: one (earlier = later), two in a repeated hour, or
-- none in a skipped one, where gap_end is the first instant after the gap.
CREATE OR REPLACE FUNCTION inbox__zone_instants(wall timestamp, zone text,
    OUT earlier timestamptz, OUT later timestamptz, OUT gap_end timestamptz)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    as_utc constant timestamptz := wall AT TIME ZONE 'UTC';
    offset_before constant interval := inbox__zone_offset(as_utc - interval '18 hours', zone);
    offset_after constant interval := inbox__zone_offset(as_utc + interval '18 hours', zone);
    with_before timestamptz := as_utc - offset_before;
    with_after timestamptz := as_utc - offset_after;
    valid_before bool;
    valid_after bool;
BEGIN
    IF offset_before = offset_after THEN
        earlier := wall AT TIME ZONE zone;
        later := earlier;
        RETURN;
    END IF;
    valid_before := (with_before AT TIME ZONE zone) = wall;
    valid_after := (with_after AT TIME ZONE zone) = wall;
    IF valid_before AND valid_after THEN
        earlier := LEAST(with_before, with_after);
        later := GREATEST(with_before, with_after);
    ELSIF valid_before OR valid_after THEN
        earlier := CASE WHEN valid_before THEN with_before ELSE with_after END;
        later := earlier;
    ELSE
        gap_end := inbox__zone_change(with_after, with_before, zone);
    END IF;
END
$$;

-- Walks local time from `start` (inclusive) forward or back to the first local time whose ticks
-- (croner's rules: a time repeated by a DST change fires at its first instant if the expression
-- names one second, minute and hour, else at both; a time skipped fires at the end of the gap in
-- the first case, else not at all) include one after `bound` (forward) or at or before it (back),
-- and returns the nearest such tick; NULL when there is none.
CREATE OR REPLACE FUNCTION inbox__cron_walk(c inbox__cron, zone text, start timestamp,
    forward bool, bound timestamptz, stop timestamp) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    wall timestamp := start;
    instants record;
    ticks timestamptz[];
    tick timestamptz;
    steps int := 0;
BEGIN
    LOOP
        steps := steps + 1;
        IF steps > 1000 THEN
            RETURN NULL;
        END IF;
        wall := inbox__cron_wall(c, wall, forward, stop);
        IF wall IS NULL THEN
            RETURN NULL;
        END IF;
        instants := inbox__zone_instants(wall, zone);
        IF instants.gap_end IS NOT NULL THEN
            ticks := CASE WHEN c.fixed AND inbox__cron_date_matches(c, (instants.gap_end AT TIME ZONE zone)::date)
                          THEN ARRAY[instants.gap_end] ELSE '{}' END;
        ELSIF c.fixed OR instants.earlier = instants.later THEN
            ticks := ARRAY[instants.earlier];
        ELSE
            ticks := ARRAY[instants.earlier, instants.later];
        END IF;
        IF forward THEN
            tick := (SELECT min(t) FROM unnest(ticks) AS t WHERE t > bound);
        ELSE
            tick := (SELECT max(t) FROM unnest(ticks) AS t WHERE t <= bound);
        END IF;
        IF tick IS NOT NULL THEN
            RETURN tick;
        END IF;
        IF instants.gap_end IS NOT NULL THEN
            -- Every local time in the gap is skipped alike.
            wall := CASE WHEN forward THEN instants.gap_end AT TIME ZONE zone
                         ELSE (instants.gap_end - interval '1 second') AT TIME ZONE zone END;
        ELSE
            wall := wall + CASE WHEN forward THEN interval '1 second' ELSE interval '-1 second' END;
        END IF;
    END LOOP;
END
$$;

-- The first tick strictly after `after` (Timetable::next_after), NULL when there is none.
CREATE OR REPLACE FUNCTION inbox__cron_next(c inbox__cron, zone text, after timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    wall constant timestamp := date_trunc('second', after AT TIME ZONE zone);
    instants record;
    upcoming timestamptz;
BEGIN
    upcoming := inbox__cron_walk(c, zone, wall + interval '1 second', true, after, NULL);
    IF NOT c.fixed THEN
        -- Before a repeated hour ends, its second pass is still to come.
        instants := inbox__zone_instants(wall, zone);
        IF instants.earlier < instants.later AND after < instants.later THEN
            upcoming := LEAST(upcoming, inbox__cron_walk(c, zone,
                inbox__zone_change(instants.earlier, instants.later, zone) AT TIME ZONE zone,
                true, after, NULL));
        END IF;
    END IF;
    RETURN upcoming;
END
$$;

-- The tick to fire at `now` for a schedule due at `due` (Timetable::fire): the latest at or
-- before `now`, never earlier than `due`.
CREATE OR REPLACE FUNCTION inbox__cron_latest(c inbox__cron, zone text, due timestamptz,
    now timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    wall constant timestamp := date_trunc('second', now AT TIME ZONE zone);
    stop constant timestamp := (due AT TIME ZONE zone) - interval '1 day';
    instants record;
    latest timestamptz;
BEGIN
    latest := inbox__cron_walk(c, zone, wall, false, now, stop);
    -- After a repeated hour's second pass began, the rest of its first pass is behind too.
    instants := inbox__zone_instants(wall, zone);
    IF instants.earlier < instants.later AND now >= instants.later THEN
        latest := GREATEST(latest, inbox__cron_walk(c, zone,
            (inbox__zone_change(instants.earlier, instants.later, zone) - interval '1 second')
                AT TIME ZONE zone,
            false, now, stop));
    END IF;
    RETURN GREATEST(COALESCE(latest, due), due);
END
$$;

-- A tick as schedule.rs formats it in messages and keys.
CREATE OR REPLACE FUNCTION inbox__cron_utc(instant timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN to_char(instant AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"');

-- The next tick of `cron` in `zone` after `after`, raising 22023 as inbox_schedule does.
CREATE OR REPLACE FUNCTION inbox__schedule_next(cron text, zone text, after timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    c constant inbox__cron := inbox__cron_parse(cron);
    upcoming timestamptz;
BEGIN
    IF NOT inbox__time_zone_known(zone) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('unknown time zone "%s"', zone);
    END IF;
    upcoming := inbox__cron_next(c, zone, after);
    IF upcoming IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format(
            'cron expression "%s" has no tick after %s: CronScheduler time search limit exceeded.',
            c.pattern, inbox__cron_utc(after));
    END IF;
    RETURN upcoming;
END
$$;

-- Deletes the schedules of queues that were dropped; with `wait` false, skips those another
-- transaction holds (and, for a role that does not own the table, all of them: it cannot lock them).
CREATE OR REPLACE FUNCTION inbox__drop_orphan_schedules(wait bool) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
BEGIN
    IF wait THEN
        DELETE FROM inbox_periodic_jobs s
         WHERE NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = s.queue::oid);
    ELSE
        DELETE FROM inbox_periodic_jobs
         WHERE ctid = ANY (ARRAY(SELECT s.ctid FROM inbox_periodic_jobs s
                                  WHERE NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = s.queue::oid)
                                    FOR UPDATE SKIP LOCKED));
    END IF;
END
$$;

-- check_queue: a jsonb queue with a key column that has a unique index, and INSERT on it.
CREATE OR REPLACE FUNCTION inbox__schedule_check_queue(queue regclass) RETURNS void
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
DECLARE
    shape constant inbox__queue_shape := inbox__queue_shape(queue);
BEGIN
    IF shape.payload <> 'jsonb' THEN
        RAISE EXCEPTION USING ERRCODE = '42804', MESSAGE = format(
            'queue %s stores %s payloads; a schedule''s payload is jsonb', shape.table_sql, shape.payload);
    END IF;
    IF NOT shape.has_key THEN
        RAISE EXCEPTION USING ERRCODE = '42703', MESSAGE = format(
            'queue %s has no column "key": a schedule dedups its ticks by key', shape.table_sql);
    END IF;
    IF NOT has_table_privilege(queue, 'INSERT') THEN
        RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
            'permission denied for table %s: a schedule enqueues jobs, which needs INSERT', shape.table_sql);
    END IF;
    -- The tick's insert skips a key already queued: ON CONFLICT (key) WHERE key IS NOT NULL
    -- needs a unique index on key alone (partial on key IS NOT NULL, or not partial).
    IF NOT EXISTS (SELECT FROM pg_index i
                     JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                    WHERE i.indrelid = queue AND i.indisunique AND i.indisvalid
                      AND i.indimmediate AND i.indnkeyatts = 1 AND a.attname = 'key'
                      AND i.indexprs IS NULL
                      AND (i.indpred IS NULL
                           OR pg_get_expr(i.indpred, i.indrelid) = '(key IS NOT NULL)')) THEN
        RAISE EXCEPTION USING ERRCODE = '42P10', MESSAGE = format(
            'column "key" of queue %s has no unique index: a schedule dedups its ticks by key',
            shape.table_sql);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION inbox_schedule(queue regclass, name text, cron text,
    payload jsonb DEFAULT '{}', time_zone text DEFAULT 'UTC') RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    upcoming timestamptz;
BEGIN
    PERFORM inbox__required(queue, 'queue');
    PERFORM inbox__required(name, 'name');
    PERFORM inbox__required(cron, 'cron');
    PERFORM inbox__required(payload, 'payload');
    PERFORM inbox__required(time_zone, 'time_zone');
    IF name = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'name must not be empty';
    END IF;
    upcoming := inbox__schedule_next(cron, time_zone, clock_timestamp());
    PERFORM inbox__schedule_check_queue(queue);
    PERFORM inbox__drop_orphan_schedules(true);
    -- Declaring the same schedule again (a service does it at every start) keeps its next
    -- tick, so that a tick due while the service was down still fires.
    INSERT INTO inbox_periodic_jobs AS s (queue, name, cron, time_zone, payload, next_tick)
    VALUES (inbox_schedule.queue, inbox_schedule.name, inbox_schedule.cron,
            inbox_schedule.time_zone, inbox_schedule.payload, upcoming)
    ON CONFLICT ON CONSTRAINT inbox_periodic_jobs_pkey DO UPDATE
       SET next_tick = CASE WHEN s.cron = excluded.cron AND s.time_zone = excluded.time_zone
                            THEN s.next_tick ELSE excluded.next_tick END,
           cron = excluded.cron, time_zone = excluded.time_zone, payload = excluded.payload;
END
$$;

CREATE OR REPLACE FUNCTION inbox_unschedule(queue regclass, name text) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM inbox__required(queue, 'queue');
    PERFORM inbox__required(name, 'name');
    PERFORM inbox__drop_orphan_schedules(true);
    DELETE FROM inbox_periodic_jobs s
     WHERE s.queue = inbox_unschedule.queue AND s.name = inbox_unschedule.name;
    RETURN FOUND;
END
$$;

-- An earlier install's inbox_schedules has no last_tick, which CREATE OR REPLACE cannot add.
DROP FUNCTION IF EXISTS inbox_schedules(regclass);
CREATE OR REPLACE FUNCTION inbox_schedules(queue regclass)
RETURNS TABLE (name text, cron text, time_zone text, payload jsonb, next_tick timestamptz,
               last_tick timestamptz)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM inbox__required(queue, 'queue');
    RETURN QUERY
        SELECT s.name, s.cron, s.time_zone, s.payload, s.next_tick, s.last_tick
          FROM inbox_periodic_jobs s
         WHERE s.queue = inbox_schedules.queue
           AND EXISTS (SELECT FROM pg_class c WHERE c.oid = inbox_schedules.queue::oid)
         ORDER BY s.name;
END
$$;

-- Enqueues the due ticks of `queue`'s schedules in the caller's transaction (enqueue_due_ticks);
-- inbox_lease and inbox_lock call it first, so that a tick's job can be taken by the same call.
CREATE OR REPLACE FUNCTION inbox__enqueue_due_ticks(queue regclass) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now constant timestamptz := clock_timestamp();
    due record;
    insert_tick text;
    table_sql text;
    c inbox__cron;
    tick timestamptz;
    upcoming timestamptz;
    problem text;
BEGIN
    FOR due IN
        SELECT s.name, s.cron, s.time_zone, s.payload, s.next_tick FROM inbox_periodic_jobs s
         WHERE s.queue = inbox__enqueue_due_ticks.queue AND s.next_tick <= now
         ORDER BY s.next_tick LIMIT 100 FOR UPDATE SKIP LOCKED
    LOOP
        IF insert_tick IS NULL THEN
            table_sql := (inbox__queue_shape(queue)).table_sql;
            -- A tick whose job is still queued inserts nothing.
            insert_tick := format('INSERT INTO %s (payload, locked_until, key) VALUES ($1, $2, $3) '
                                  'ON CONFLICT (key) WHERE key IS NOT NULL DO NOTHING', table_sql);
        END IF;
        problem := NULL;
        BEGIN
            c := inbox__cron_parse(due.cron);
            IF NOT inbox__time_zone_known(due.time_zone) THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('unknown time zone "%s"', due.time_zone);
            END IF;
            tick := inbox__cron_latest(c, due.time_zone, due.next_tick, now);
            upcoming := inbox__cron_next(c, due.time_zone, now);
            IF upcoming IS NULL THEN
                problem := format('cron expression "%s" has no tick after %s: CronScheduler time search limit exceeded.',
                                  c.pattern, inbox__cron_utc(now));
            END IF;
        EXCEPTION WHEN invalid_parameter_value THEN
            problem := SQLERRM;
        END;
        IF problem IS NULL THEN
            EXECUTE insert_tick
              USING due.payload, tick, 'schedule:' || due.name || ':' || inbox__cron_utc(tick);
        ELSE
            -- Only a schedule stored by another version of the cron or time zone rules gets
            -- here: it is parked rather than failing every lease of its queue.
            RAISE WARNING USING MESSAGE = format('inbox: schedule "%s" of queue %s is paused: %s',
                                                 due.name, table_sql, problem);
            upcoming := 'infinity';
        END IF;
        UPDATE inbox_periodic_jobs s
           SET next_tick = upcoming, last_tick = CASE WHEN problem IS NULL THEN tick ELSE s.last_tick END
         WHERE s.queue = inbox__enqueue_due_ticks.queue AND s.name = due.name;
    END LOOP;
    IF insert_tick IS NOT NULL THEN
        PERFORM inbox__drop_orphan_schedules(false);
    END IF;
END
$$;

-- The extension's event trigger function (schedule.rs), deleting the schedules of the tables a
-- command dropped with the rights of whoever dropped them.
CREATE OR REPLACE FUNCTION inbox_drop_schedules_of_dropped_tables() RETURNS event_trigger
LANGUAGE plpgsql SECURITY INVOKER SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM inbox_periodic_jobs
     WHERE queue::oid IN (SELECT objid FROM pg_event_trigger_dropped_objects()
                           WHERE classid = 'pg_class'::regclass AND objsubid = 0);
    DELETE FROM inbox_relays
     WHERE outbox::oid IN (SELECT objid FROM pg_event_trigger_dropped_objects()
                            WHERE classid = 'pg_class'::regclass AND objsubid = 0);
    DELETE FROM inbox_queue_controls
     WHERE queue::oid IN (SELECT objid FROM pg_event_trigger_dropped_objects()
                           WHERE classid = 'pg_class'::regclass AND objsubid = 0);
END
$$;
REVOKE ALL ON FUNCTION inbox_drop_schedules_of_dropped_tables() FROM PUBLIC;

DO $$
BEGIN
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
       AND NOT EXISTS (SELECT FROM pg_event_trigger
                        WHERE evtname = 'inbox_drop_schedules_of_dropped_tables') THEN
        CREATE EVENT TRIGGER inbox_drop_schedules_of_dropped_tables ON sql_drop
            EXECUTE FUNCTION inbox_drop_schedules_of_dropped_tables();
    END IF;
END
$$;
